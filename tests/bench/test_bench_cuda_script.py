"""scripts/bench_cuda.py runs only where a GPU is, so it is dry-run here on the CPU
(--device cpu: the same setup, rotation, packing and records on the reference / CPU
ops). On its first GPU run the script failed to import the package, which was not
installed there (it now puts the repository on sys.path; the editable install here
hides that case); this dry run keeps the rest of it exercised."""
import json
import subprocess
import sys


def test_bench_cuda_dry_run_on_cpu(repo_root, tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "bench_cuda.py"), "--device", "cpu", "--shapes", "128x256",
         "--m", "1", "3", "--reps", "1", "--inner", "1", "--rotate-mb", "0.2", "--bw", "1e11", "--dtype", "bfloat16",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert {(r["m"], r["kernel"]) for r in rows} == {(m, k) for m in (1, 3)
                                                     for k in ("cublas_fp16", "w4a16", "w8a8", "torch_int4")}
    assert all(r["us"] > 0 and r["n"] == 128 and r["k"] == 256 for r in rows)
    # PyTorch's int4 kernel was given the same matrix as ours (its error line is printed)
    err = float(proc.stdout.split("relative error against the dequantized fp16 product ")[1].split()[0])
    assert err < 1e-2
