"""Figures of `compress bench serve`: percentiles, per-run summaries, the long-prompt
stall, ratios between peers and the table."""
import math
import random

import numpy as np
import pytest

from compress.bench.serve.client import RequestResult
from compress.bench.serve.report import (add_ratios, long_prompt_stall, long_prompt_table, markdown_table,
                                         percentile, summarize)


def test_percentile_matches_numpy_linear():
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.uniform(0, 100) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1], 101)


def _req(issued, tokens, max_tokens=None, role="request", prompt_len=10, end=None, error=None):
    r = RequestResult(prompt_len=prompt_len, max_tokens=max_tokens or len(tokens), role=role, issued=issued,
                      sent=issued, token_times=list(tokens), end=end if end is not None else tokens[-1],
                      error=error)
    r.output_tokens = len(tokens)
    return r


def test_summarize():
    a = _req(0.0, [0.1, 0.2, 0.3, 0.4])          # ttft 100 ms, gaps 100 ms
    b = _req(0.0, [0.3, 0.5, 0.7], max_tokens=5)  # ttft 300 ms, gaps 200 ms, asked 5 got 3
    bad = _req(0.0, [0.1], error="HTTP 503: full")
    s = summarize([a, b, bad])
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 503: full"]
    assert s["duration_s"] == pytest.approx(0.7)
    assert s["output_tokens"] == 7 and s["prompt_tokens"] == 20
    assert s["output_throughput"] == pytest.approx(7 / 0.7)
    assert s["request_throughput"] == pytest.approx(2 / 0.7)
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["ttft_ms"]["mean"] == pytest.approx(200)
    assert s["itl_ms"]["p50"] == pytest.approx(100) and s["itl_ms"]["p99"] == pytest.approx(200)
    assert s["tpot_ms"]["p50"] == pytest.approx(150)
    assert s["e2e_ms"]["p90"] == pytest.approx(400 + 0.9 * 300)
    assert s["output_len_mismatches"] == 1


def test_long_prompt_stall():
    # two running requests: 50 ms gaps, except one 600 ms gap each while the long prompt
    # (issued at 1.0, first token at 1.6) is prefilled
    def running(offset):
        t = [offset + 0.05 * i for i in range(20)]           # up to ~0.95
        t += [t[-1] + 0.6] + [t[-1] + 0.6 + 0.05 * i for i in range(1, 10)]
        return _req(0.0, t, role="running")
    long = _req(1.0, [1.6, 1.65], role="long", prompt_len=2000)
    s = long_prompt_stall([[running(0.0), running(0.01), long]])
    assert s["long_ttft_ms"] == pytest.approx(600)
    assert s["itl_median_outside_ms"] == pytest.approx(50)
    assert s["itl_max_during_ms"] == pytest.approx(600)
    assert s["gaps_during"] >= 2 and s["p99_during_over_median"] > 10
    assert s["running_at_first_token"] == 2
    assert long_prompt_stall([[running(0.0)]]) is None
    twice = long_prompt_stall([[running(0.0), running(0.01), long], [running(0.0), long]])
    assert twice["runs"] == 2 and twice["gaps_during"] == s["gaps_during"] * 3 // 2
    assert twice["running_at_first_token"] == 1


def _row(peer, load, tok_s, ttft=100.0):
    d = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": ttft}
    return {"peer": peer, "workload": "random", "load": load, "completed": 4, "failed": 0, "output_throughput": tok_s,
            "request_throughput": 1.0, "ttft_ms": d, "tpot_ms": d, "itl_ms": d, "e2e_ms": d}


def test_ratios_and_table():
    rows = [_row("ours", "c=16", 300.0, ttft=50.0), _row("ours-serial", "c=16", 100.0), _row("llamacpp", "c=16", 200.0),
            _row("ours", "c=1", 40.0)]
    add_ratios(rows)
    assert rows[0]["vs_ours-serial"]["output_throughput"] == pytest.approx(3.0)
    assert rows[0]["vs_llamacpp"]["output_throughput"] == pytest.approx(1.5)
    assert rows[0]["vs_llamacpp"]["ttft_p50"] == pytest.approx(0.5)
    assert "vs_llamacpp" not in rows[3], "no llama-server row at c=1"
    table = markdown_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + 4 and "vs ours-serial: out tok/s, TTFT mean" in lines[0] and "vs llamacpp:" in lines[0]
    assert "ours-no-prefix-cache" not in lines[0], "only baselines that ran get a column"
    assert "| ours | random | c=16 | 4/0 | 50/50/50 |" in lines[2] and "| 3.00x, 0.50x | 1.50x, 0.50x |" in lines[2]
    assert lines[5].endswith("| -, - | -, - |")
    assert long_prompt_table(rows) == ""


def test_a_stream_that_holds_tokens_back_is_flagged():
    r = _req(0.0, [0.5], max_tokens=8)     # one chunk for 8 tokens (a server that sent only text)
    r.output_tokens = 8
    s = summarize([r])
    assert s["chunks_per_token"] == pytest.approx(1 / 8) and s["output_tokens"] == 8
    # no token chunk at all (all text in the closing chunk): counted, but it has no TTFT
    silent = RequestResult(prompt_len=10, max_tokens=8, issued=0.0, end=0.9)
    silent.output_tokens = 8
    s = summarize([r, silent])
    assert silent.ok and silent.ttft is None and silent.tpot is None
    assert s["completed"] == 2 and s["output_tokens"] == 16 and s["ttft_ms"]["p50"] == pytest.approx(500)
    assert s["e2e_ms"]["p50"] == pytest.approx(700)
    rows = [{**_row("ours", "c=1", 10.0), "chunks_per_token": 0.125}, {**_row("llamacpp", "c=1", 10.0),
                                                                       "chunks_per_token": 1.0}]
    table = markdown_table(rows)
    assert "note: ours streamed as few as 0.12 chunks per generated token" in table and "note: llamacpp" not in table


def test_rounds_pool_latencies_and_take_the_median_throughput():
    from compress.bench.serve.report import summarize_rounds

    rounds = [[_req(0.0, [0.1, 0.2])], [_req(10.0, [10.3, 10.4, 10.5])], [_req(20.0, [20.2, 20.4])]]
    s = summarize_rounds(rounds)
    assert s["completed"] == 3 and len(s["rounds"]) == 3
    assert [r["output_throughput"] for r in s["rounds"]] == pytest.approx([10.0, 6.0, 5.0])
    assert s["output_throughput"] == pytest.approx(6.0)            # the median round, not 7 / 30 s
    assert s["ttft_ms"]["p50"] == pytest.approx(200)               # 100, 300, 200 pooled
    assert summarize_rounds(rounds[:1])["output_throughput"] == summarize(rounds[0])["output_throughput"]
