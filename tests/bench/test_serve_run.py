"""Load shapes of `compress bench serve` against a real local SSE server: the concurrency
limit, Poisson send times and the long prompt sent among running decodes."""
import asyncio

from openai_stub_server import StubServer

from compress.bench.serve.run import (Target, completion_body, run_arrivals, run_concurrency, run_long_prompt,
                                      served_model, warm_up)
from compress.bench.serve.workload import BenchRequest


def _reqs(n, tokens=4):
    return [BenchRequest(tuple(range(i, i + 8)), tokens) for i in range(n)]


def test_body_asks_for_exact_streamed_greedy_tokens():
    body = completion_body(BenchRequest((5, 6, 7), 9), Target("http://x", "m", extra_body={"top_k": 1}))
    assert body == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True, "top_k": 1}


def test_concurrency_is_the_most_in_flight():
    with StubServer(token_delay=0.01, first_delay=0.01) as server:
        target = Target(server.url, served_model(server.url))
        assert target.model == "stub-model"
        results = asyncio.run(run_concurrency(target, _reqs(9), concurrency=3))
        assert server.max_in_flight == 3
        assert [r.prompt_len for r in results] == [8] * 9 and all(r.ok and r.output_tokens == 4 for r in results)
        assert sorted(tuple(b["prompt"]) for b in server.received[:3]) == [r.prompt for r in _reqs(3)]
        assert asyncio.run(warm_up(target, tuple(range(40)))).ok
        assert server.received[-1]["prompt"] == list(range(16)) and server.received[-1]["max_tokens"] == 4


def test_arrivals_send_on_schedule():
    with StubServer(token_delay=0.001, first_delay=0.001) as server:
        results = asyncio.run(run_arrivals(Target(server.url), _reqs(3, tokens=2), [0.0, 0.15, 0.3]))
        at = [b["at"] for b in server.received]
    assert all(r.ok for r in results)
    assert 0.12 <= at[1] - at[0] <= 0.4 and 0.27 <= at[2] - at[0] <= 0.55


def test_long_prompt_comes_after_the_running_first_tokens():
    reqs = [BenchRequest((1, 2, 3), 30, "running"), BenchRequest((4, 5), 30, "running"),
            BenchRequest(tuple(range(50)), 3, "long")]
    with StubServer(token_delay=0.01, first_delay=0.02) as server:
        results = asyncio.run(run_long_prompt(Target(server.url), reqs, long_after=0.05))
    running, long = results[:2], results[2]
    assert [r.role for r in results] == ["running", "running", "long"] and long.prompt_len == 50
    assert all(r.ok for r in results)
    assert long.issued >= max(r.token_times[0] for r in running) + 0.05
    assert long.issued < min(r.token_times[-1] for r in running), "the others still decode when it comes"
