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


def _rec(engine, scheme, batch, prefill, decode, limit=1000.0, kv="", rounds=None):
    from compress.bench.model import ModelRecord

    pre, dec = rounds or ([], [])
    return ModelRecord(engine, scheme, batch, 2, 64, 64, prefill, decode, 1, limit, kv, pre, dec)


def test_comparison_pairs_engines_by_bit_width_and_batch_with_prefill():
    """ours / llama.cpp (same bit width) and / transformers at the same batch, for decode
    and prefill; the batch-1 rows put both decodes beside their bandwidth limits."""
    from compress.bench.model import compare, comparison_lines

    recs = [_rec("compress", "w4a16+w8a8", 1, 90.0, 50.0, 200.0, "f16"), _rec("compress", "w8a8", 16, 500.0, 120.0),
            _rec("llama.cpp", "q4_0", 1, 100.0, 100.0, 250.0, "f16"), _rec("llama.cpp", "q8_0", 1, 80.0, 60.0),
            _rec("llama.cpp", "q8_0", 16, 400.0, 150.0), _rec("transformers", "float32", 1, 30.0, 10.0)]
    comp = compare(recs)
    assert [(c["scheme"], c["batch"], c["baseline"]) for c in comp] == [
        ("w4a16+w8a8", 1, "llama.cpp q4_0"), ("w4a16+w8a8", 1, "transformers float32"),
        ("w8a8", 16, "llama.cpp q8_0")]
    assert comp[0]["decode_ratio"] == 0.5 and comp[0]["prefill_ratio"] == 0.9
    assert comp[0]["decode_of_limit"] == 0.25 and comp[0]["baseline_decode_of_limit"] == 0.4
    assert comp[2]["decode_ratio"] == 0.8 and comp[2]["prefill_ratio"] == 1.25
    lines = comparison_lines(comp)
    assert lines[0].split()[-3:] == ["batch", "decode", "prefill"]
    assert lines[1].startswith("# compress w4a16+w8a8 (kv f16) / llama.cpp q4_0")
    assert lines[1].split()[8:13] == ["1", "0.50x", "[0.50-0.50]", "0.90x", "[0.90-0.90]"]
    assert lines[1].endswith("decode at 25% of the bandwidth limit (40% for llama.cpp q4_0)")
    assert lines[3].split()[6:11] == ["16", "0.80x", "[0.80-0.80]", "1.25x", "[1.25-1.25]"]
    assert "limit" not in lines[3]


def test_ratios_are_taken_round_by_round():
    """A slow round hits both engines alike: the ratio is the median of the rounds'
    ratios (not of the medians), with the range beside it."""
    from compress.bench.model import compare

    ours = _rec("compress", "w4a16", 1, 100.0, 100.0, rounds=([100.0, 10.0, 100.0], [100.0, 10.0, 120.0]))
    theirs = _rec("llama.cpp", "q4_0", 1, 100.0, 80.0, rounds=([50.0, 10.0, 100.0], [80.0, 5.0, 100.0]))
    (c,) = compare([ours, theirs])
    assert c["decode_ratio"] == 1.25 and c["decode_ratio_range"] == [1.2, 2.0]
    assert c["prefill_ratio"] == 1.0 and c["prefill_ratio_range"] == [1.0, 2.0]


def test_parser_registers_llamacpp_build():
    from compress.bench import llamacpp

    a = _parser().parse_args(["bench", "llamacpp", "--dir", "d", "--cmake-arg=-DGGML_AMX_INT8=OFF"])
    assert a.func is llamacpp.main and a.dir == "d" and a.cmake_arg == ["-DGGML_AMX_INT8=OFF"]
    a = _parser().parse_args(["bench", "model", "--hf", "src", "--llamacpp-dir", "d"])
    assert a.llamacpp_dir == "d" and not hasattr(a, "llamacpp_converter")


def test_llamacpp_engine_without_built_tools_says_what_to_run(tmp_path, tiny_llama_dir):
    """The default engines include llama.cpp: with --hf and no tools built, the run stops
    before any timing with the command that builds them."""
    from compress.bench import model
    from compress.bench.llamacpp import LlamaCppToolsError

    a = _parser().parse_args(["bench", "model", "--hf", str(tiny_llama_dir), "--engines", "llamacpp",
                              "--llamacpp-dir", str(tmp_path / "none"), "--bandwidth-mib", "8"])
    log = []
    with pytest.raises(LlamaCppToolsError, match=r"run `compress bench llamacpp --dir .*none` first"):
        model.run(a, log=log.append)
    assert log == [], "nothing is measured before the check"


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
    assert result["cpu"]["model"] and isinstance(result["cpu"]["flags"], list) and result["threads"] == 1
    assert any(line.startswith("# CPU: ") for line in log)
    assert [line for line in log if line.startswith("# round")] == ["# round 1/2: every engine in turn",
                                                                    "# round 2/2: every engine in turn"]
    recs = result["records"]
    assert [(r["engine"], r["kv_cache"], r["batch"]) for r in recs] == [
        ("compress", "f32", 1), ("compress", "f32", 2), ("compress", "f16", 1), ("compress", "f16", 2),
        ("transformers", "f32", 1), ("transformers", "f32", 2)]
    for r in recs:
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["weight_bytes_per_token"] > 0
        assert len(r["decode_rounds"]) == len(r["prefill_rounds"]) == 2
        assert sorted(r["decode_rounds"])[0] <= r["decode_tok_s"] <= sorted(r["decode_rounds"])[1]
        bw = result["bandwidth"]["best_gbps"]
        assert abs(r["bandwidth_limit_tok_s"] - bw * 1e9 / r["weight_bytes_per_token"] * r["batch"]) < 1e-6 * r["bandwidth_limit_tok_s"]
    assert any(line.startswith("# compress ") and "(kv f16) / transformers float32" in line for line in log)
    assert {(c["batch"], c["kv_cache"]) for c in result["comparison"]} == {(1, "f32"), (2, "f32"), (1, "f16"),
                                                                           (2, "f16")}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here: --device cuda would run")
def test_model_bench_on_cuda_without_a_gpu_is_a_clear_error(tiny_llama_dir):
    from compress.bench import model
    from compress.errors import UserError
    a = _parser().parse_args(["bench", "model", str(tiny_llama_dir), "--device", "cuda", "--engines", "compress",
                              "--cuda-graphs", "on", "off"])
    assert a.cuda_graphs == ["on", "off"]
    with pytest.raises(UserError, match="--device cuda: torch sees no CUDA device"):
        model.run(a, log=lambda line: None)
