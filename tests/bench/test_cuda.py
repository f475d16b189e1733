"""`compress bench cuda` measures only where a GPU is, so here it is dry-run on the CPU
(--device cpu: the same setup, weight rotation, packing and records on the reference /
CPU ops)."""
import json

from compress.cli import main


def test_bench_cuda_dry_run_on_cpu(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = main(["bench", "cuda", "--device", "cpu", "--shapes", "128x256", "--m", "1", "3", "--reps", "1",
               "--inner", "1", "--rotate-mb", "0.2", "--bw", "1e11", "--dtype", "bfloat16", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = result["records"]
    assert {(r["m"], r["kernel"]) for r in rows} == {(m, k) for m in (1, 3)
                                                     for k in ("cublas_fp16", "w4a16", "w8a8", "torch_int4")}
    assert all(r["us"] > 0 and r["n"] == 128 and r["k"] == 256 for r in rows)
    assert result["device"] == "CPU dry run" and result["bandwidth_bytes_per_s"] == 1e11
    # PyTorch's int4 kernel was given the same matrix as ours
    assert result["torch_int4_rel_error"]["128x256"] < 1e-2
    assert "relative error against the dequantized fp16 product" in capsys.readouterr().out


def test_bench_cuda_without_a_gpu_measures_nothing(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "rows.json"
    assert main(["bench", "cuda", "--json", str(out)]) == 0
    assert "no CUDA device; nothing to measure" in capsys.readouterr().out
    assert not out.exists()
