"""scripts/ab_w8a8_many_rows.py --model: prefill of a packed int8 checkpoint (here the
embedded model's RTN export) with a many-row path (the int16 GEMM, the AMX tiles) on and
off, one line per prompt length, logits compared."""
import subprocess
import sys

import pytest

from compress.ops import native_available
from embedded_rtn import export_rtn


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
@pytest.mark.parametrize("path,on,off", [("int16", "int16", "bytes"), ("amx", "amx", "vnni")])
def test_ab_w8a8_many_rows_on_a_checkpoint(repo_root, tmp_path, embedded, path, on, off):
    q = export_rtn(embedded, 8, tmp_path / "q")
    proc = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "ab_w8a8_many_rows.py"), "--path", path, "--threads", "1",
         "--model", str(q),
         "--prompt-tokens", "40", "70", "--rounds", "1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("prefill")]
    assert [int(line.split()[1]) for line in lines] == [40, 70]
    assert all(f"{on}/{off}" in line and "DIFFER" not in line for line in lines)
