"""scripts/ab_w8a8_int16.py times the W8A8 int16 GEMM against the byte tiles in one
process; run here on small shapes: it prints one line per (M, shape) with both rates and
their ratio, finds the two int8 paths' outputs equal, and puts the row threshold back."""
import subprocess
import sys

import pytest

from compress import ops

pytestmark = pytest.mark.skipif(not ops.native_available("cpu"), reason="compress._C not built")


def test_ab_w8a8_int16_runs_and_compares(repo_root, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "ab_w8a8_int16.py"), "--threads", "1", "--m", "3", "64",
         "--shapes", "40x100", "32x256", "--rounds", "1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("M=")]
    assert len(lines) == 4 and not any("DIFFER" in line for line in lines)
    assert all("int16/bytes" in line and "bytes/fp32" in line for line in lines)
    assert "int16 GEMM from M=16" in proc.stdout
