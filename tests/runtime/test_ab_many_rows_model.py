"""scripts/ab_many_rows.py --model: prefill of a packed checkpoint (here the embedded
model's RTN export: int8 for the W8A8 paths, int4 for the W4A16 AMX tiles) with a
many-row path on and off, one line per prompt length, logits compared."""
import subprocess
import sys

import pytest

from compress.ops import native_available
from embedded_rtn import export_rtn


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
@pytest.mark.parametrize("path,on,off,bits", [("int16", "int16", "bytes", 8), ("amx", "amx", "vnni", 8),
                                              ("w4-amx", "amx", "int8", 4)])
def test_ab_many_rows_on_a_checkpoint(repo_root, tmp_path, embedded, path, on, off, bits):
    q = export_rtn(embedded, bits, tmp_path / "q")
    proc = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "ab_many_rows.py"), "--path", path, "--threads", "1",
         "--model", str(q),
         "--prompt-tokens", "40", "70", "--rounds", "1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("prefill")]
    assert [int(line.split()[1]) for line in lines] == [40, 70]
    assert all(f"{on}/{off}" in line and "DIFFER" not in line and "TOO LOW" not in line for line in lines)
