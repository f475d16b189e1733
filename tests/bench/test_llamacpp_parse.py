"""Reading llama.cpp's benchmark tools: ``llama-bench -o json`` and llama-batched-bench's
table, from output captured once from the tools built by ``compress bench llamacpp``
(llama-cpp-python 0.3.36's llama.cpp, the embedded model's Q4_0 GGUF, 2 threads):

    llama-bench -m model-q4_0.gguf -p 64 -n 64 -d 0,64 -t 2 -r 2 -o json
    llama-batched-bench -m model-q4_0.gguf -c 2064 -b 2048 -ub 512 -npp 64 -ntg 64 -npl 1,16 -t 2 -tb 2
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from compress.bench import llamacpp_bench
from compress.bench.llamacpp import LlamaCppTools
from compress.bench.llamacpp_bench import (LlamaCppRunError, parse_batched_bench, parse_llama_bench_json,
                                           select_test)

SAMPLES = Path(__file__).parent / "samples"
LLAMA_BENCH_JSON = (SAMPLES / "llama_bench_pp64_tg64_d0_64.json").read_text()
BATCHED_BENCH = (SAMPLES / "llama_batched_bench_npl1_16.txt").read_text()


def test_llama_bench_json_gives_one_row_per_test():
    tests = parse_llama_bench_json(LLAMA_BENCH_JSON)
    assert [(t["kind"], t["n_tokens"], t["n_depth"]) for t in tests] == [
        ("pp", 64, 0), ("tg", 64, 0), ("pp", 64, 64), ("tg", 64, 64)]
    raw = json.loads(LLAMA_BENCH_JSON)
    for t, r in zip(tests, raw):
        assert t["tok_s"] == pytest.approx(r["avg_ts"]) and t["samples_ts"] == r["samples_ts"]
        assert t["threads"] == 2 and t["type_k"] == "f16" and t["model_size"] == 4117504


def test_select_test_picks_prefill_on_empty_context_and_decode_after_the_prompt():
    tests = parse_llama_bench_json(LLAMA_BENCH_JSON)
    raw = json.loads(LLAMA_BENCH_JSON)
    assert select_test(tests, "pp", 64, 0)["tok_s"] == pytest.approx(raw[0]["avg_ts"])
    assert select_test(tests, "tg", 64, 64)["tok_s"] == pytest.approx(raw[3]["avg_ts"])
    with pytest.raises(LlamaCppRunError, match=r"no tg128 test at depth 64 \(it has: pp64@d0, tg64@d0, pp64@d64, tg64@d64\)"):
        select_test(tests, "tg", 128, 64)


def test_llama_bench_json_after_log_lines_and_bad_output():
    assert len(parse_llama_bench_json("load_backend: loaded CPU backend\n" + LLAMA_BENCH_JSON)) == 4
    with pytest.raises(LlamaCppRunError, match="no readable JSON"):
        parse_llama_bench_json("[\n  {\n    \"build_commit\": ")
    with pytest.raises(LlamaCppRunError, match="no tests"):
        parse_llama_bench_json("error: failed to load model\n")
    with pytest.raises(LlamaCppRunError, match="avg_ts"):
        parse_llama_bench_json('[{"n_prompt": 64, "n_gen": 0, "n_threads": 2, "model_size": 1}]')


def test_batched_bench_table_rows():
    rows = parse_batched_bench(BATCHED_BENCH)
    assert rows == [
        {"pp": 64, "tg": 64, "batch": 1, "prefill_tok_s": 68.38, "decode_tok_s": 2.54},
        {"pp": 64, "tg": 64, "batch": 16, "prefill_tok_s": 1591.19, "decode_tok_s": 652.94},
    ]


def test_batched_bench_without_table_is_an_error():
    head = BATCHED_BENCH.split("|    PP")[0]
    with pytest.raises(LlamaCppRunError, match="printed no results table"):
        parse_batched_bench(head)
    garbled = BATCHED_BENCH.replace("1591.19", "nan?")
    with pytest.raises(LlamaCppRunError, match="row not understood"):
        parse_batched_bench(garbled)


def _tools(bench="", batched=""):
    return LlamaCppTools(version="x", source_dir="", cmake_args=[], cpu={},
                         tools={"llama-bench": bench, "llama-batched-bench": batched, "llama-quantize": ""})


def test_runners_call_the_tools_with_our_threads_and_lengths(monkeypatch):
    """Batch 1 through llama-bench (prefill at depth 0, decode after the prompt), batch 16
    through llama-batched-bench (-npl 16, a context for 16 x (prompt + new tokens))."""
    calls = []

    def fake_run(cmd, what, env=None, stdout_only=False):
        calls.append(cmd)
        return LLAMA_BENCH_JSON if "llama-bench" in cmd[0] else BATCHED_BENCH

    monkeypatch.setattr(llamacpp_bench, "_run_tool", fake_run)
    tools = _tools("/t/llama-bench", "/t/llama-batched-bench")
    raw = json.loads(LLAMA_BENCH_JSON)
    prefill, decode = llamacpp_bench.llamacpp_runner(tools, Path("m.gguf"), 1, 64, 64, threads=2)()
    assert (prefill, decode) == (pytest.approx(raw[0]["avg_ts"]), pytest.approx(raw[3]["avg_ts"]))
    assert calls[0] == ["/t/llama-bench", "-m", "m.gguf", "-p", "64", "-n", "64", "-d", "0,64", "-t", "2",
                        "-r", "1", "-o", "json"]
    assert llamacpp_bench.llamacpp_runner(tools, Path("m.gguf"), 16, 64, 64, threads=2)() == (1591.19, 652.94)
    cmd = calls[1]
    assert cmd[0] == "/t/llama-batched-bench"
    assert {cmd[cmd.index(k) + 1] for k in ("-npl", "-t", "-tb")} == {"16", "2"}
    assert int(cmd[cmd.index("-c") + 1]) >= 16 * 128
    with pytest.raises(LlamaCppRunError, match="no row for batch 4"):
        llamacpp_bench.llamacpp_runner(tools, Path("m.gguf"), 4, 64, 64, threads=2)()
