"""scripts/ab_w8a8_many_rows.py times a W8A8 many-row path (the int16 GEMM, the AMX
tiles) against the tiles it replaces in one process; run here on small shapes for both
paths (on a CPU without the path both sides run the same tiles): it prints one line per
(M, shape) with both rates and their ratio, finds the two int8 paths' outputs equal, and
puts the row threshold back."""
import subprocess
import sys

import pytest

from compress import ops

pytestmark = pytest.mark.skipif(not ops.native_available("cpu"), reason="compress._C not built")


@pytest.mark.parametrize("path,on,off,what", [("int16", "int16", "bytes", "int16 GEMM"),
                                              ("amx", "amx", "vnni", "AMX tiles")])
def test_ab_w8a8_many_rows_runs_and_compares(repo_root, tmp_path, path, on, off, what):
    proc = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "ab_w8a8_many_rows.py"), "--path", path, "--threads", "1",
         "--m", "3", "64", "--shapes", "40x100", "32x256", "--rounds", "1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("M=")]
    assert len(lines) == 4 and not any("DIFFER" in line for line in lines)
    assert all(f"{on}/{off}" in line and f"{off}/fp32" in line for line in lines)
    assert f"{what} from M=16" in proc.stdout
