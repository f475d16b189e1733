"""`compress bench` wiring: the parser registers, and a tiny kernels sweep writes the
documented JSON records (speed itself is never asserted in tests)."""
from __future__ import annotations

import argparse
import json

import pytest

import compress.ops as ops
from compress.bench import add_bench_parser, kernels


def _parser():
    p = argparse.ArgumentParser()
    add_bench_parser(p.add_subparsers(dest="command"))
    return p


def test_parser_registers_kernels_and_model():
    p = _parser()
    a = p.parse_args(["bench", "kernels", "--shapes", "64x128", "--m", "1", "--json", "x.json"])
    assert a.func is kernels.main and a.shapes == ["64x128"] and a.m == [1]
    a = p.parse_args(["bench", "model", "ckpt", "--batch", "1", "--engines", "compress"])
    assert a.paths == ["ckpt"] and a.batch == [1]


@pytest.mark.skipif(not ops.native_available("cpu"), reason="compress._C not built")
def test_kernels_bench_tiny_sweep(tmp_path):
    out = tmp_path / "k.json"
    a = _parser().parse_args(["bench", "kernels", "--shapes", "64x256", "--m", "1", "3", "--impl", "compress",
                              "torch", "--reps", "3", "--bandwidth-mib", "8", "--json", str(out)])
    assert a.func(a) == 0
    data = json.loads(out.read_text())
    assert data["bandwidth"]["best_gbps"] > 0
    rec = data["records"][0]
    assert {"op", "implementation", "M", "N", "K", "median_s", "gbps", "gflops"} <= set(rec)
    assert {r["M"] for r in data["records"]} == {1, 3}


def test_decode_ratios_pair_engines_by_bit_width_and_batch():
    from compress.bench.model import ModelRecord, decode_ratios

    def rec(engine, scheme, batch, decode):
        return ModelRecord(engine, scheme, batch, 2, 64, 64, 1.0, decode, 1, 1.0)

    lines = decode_ratios([rec("compress", "w4a16+w8a8", 1, 50.0), rec("compress", "w8a8", 1, 30.0),
                           rec("compress", "w8a8", 16, 120.0), rec("llama.cpp", "q4_0", 1, 100.0),
                           rec("llama.cpp", "q8_0", 1, 60.0), rec("transformers", "float32", 1, 10.0)])
    assert lines == [
        "# decode, batch 1: compress w4a16+w8a8 = 0.50x llama.cpp q4_0, 5.00x transformers float32",
        "# decode, batch 1: compress w8a8 = 0.50x llama.cpp q8_0, 3.00x transformers float32",
    ]


def test_model_bench_says_which_engines_need_hf(tiny_llama_dir):
    """Without --hf the llama.cpp and transformers engines cannot run; the log says so
    instead of leaving them out silently (both are in the default --engines)."""
    log = []
    a = _parser().parse_args(["bench", "model", str(tiny_llama_dir), "--batch", "1", "--prompt-len", "4",
                              "--new-tokens", "2", "--reps", "1", "--threads", "1", "--bandwidth-mib", "8",
                              "--kv-cache-dtypes", "model"])
    from compress.bench import model
    result = model.run(a, log=log.append)
    assert "# skipped llamacpp and transformers: they run the dense source model, pass it with --hf DIR" in log
    assert {r["engine"] for r in result["records"]} == {"compress"}


def test_model_bench_alternates_engines_and_writes_records(tmp_path, tiny_llama_dir):
    """compress (exact and float16 KV cache) and transformers on a tiny model, two rounds:
    one record per engine x scheme x KV cache x batch, medians of both rounds, bandwidth
    limits from the measured probe."""
    out = tmp_path / "m.json"
    log = []
    a = _parser().parse_args(["bench", "model", str(tiny_llama_dir), "--hf", str(tiny_llama_dir),
                              "--engines", "compress", "transformers", "--hf-dtypes", "float32", "--batch", "1", "2",
                              "--prompt-len", "8", "--new-tokens", "4", "--reps", "2", "--threads", "1",
                              "--bandwidth-mib", "8", "--json", str(out)])
    from compress.bench import model
    result = model.run(a, log=log.append)
    assert [line for line in log if line.startswith("# round")] == ["# round 1/2: every engine in turn",
                                                                    "# round 2/2: every engine in turn"]
    recs = result["records"]
    assert [(r["engine"], r["kv_cache"], r["batch"]) for r in recs] == [
        ("compress", "f32", 1), ("compress", "f32", 2), ("compress", "f16", 1), ("compress", "f16", 2),
        ("transformers", "f32", 1), ("transformers", "f32", 2)]
    for r in recs:
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["weight_bytes_per_token"] > 0
        bw = result["bandwidth"]["best_gbps"]
        assert abs(r["bandwidth_limit_tok_s"] - bw * 1e9 / r["weight_bytes_per_token"] * r["batch"]) < 1e-6 * r["bandwidth_limit_tok_s"]
    assert any(line.startswith("# decode, batch 2: compress") and "(kv f16)" in line for line in log)
