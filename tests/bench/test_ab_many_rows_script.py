"""scripts/ab_many_rows.py times a many-row kernel path (the W8A8 int16 GEMM, the W8A8 and
W4A16 AMX tiles) against the tiles it replaces in one process; run here on small shapes
for every path (on a CPU without the path both sides run the same tiles): it prints one
line per (M, shape) with both rates and their ratio, finds the two sides' outputs equal
(the W8A8 paths) or within 40 dB of each other (W4A16 on bf16 tiles)."""
import subprocess
import sys

import pytest

from compress import ops

pytestmark = pytest.mark.skipif(not ops.native_available("cpu"), reason="compress._C not built")


@pytest.mark.parametrize("path,on,off,what", [("int16", "int16", "bytes", "int16 GEMM from M=16"),
                                              ("amx", "amx", "vnni", "AMX tiles from M=16"),
                                              ("w4-amx", "amx", "int8", "W4A16 AMX tiles from M=32")])
def test_ab_many_rows_runs_and_compares(repo_root, tmp_path, path, on, off, what):
    proc = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "ab_many_rows.py"), "--path", path, "--threads", "1",
         "--m", "3", "64", "--shapes", "40x128", "32x256", "--rounds", "1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("M=")]
    assert len(lines) == 4 and not any("DIFFER" in line or "TOO LOW" in line for line in lines)
    assert all(f"{on}/{off}" in line and f"{off}/fp32" in line for line in lines)
    assert all(("sqnr(on, off)" in line) == (path == "w4-amx") for line in lines)
    assert what in proc.stdout
