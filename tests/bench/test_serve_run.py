"""Load shapes of `compress bench serve` against a real local SSE server: the concurrency
limit, Poisson send times and the long prompt sent among running decodes."""
import asyncio
import time

import pytest

from openai_stub_server import StubServer

from compress.bench.serve.run import (Target, completion_body, run_arrivals, run_concurrency, run_long_prompt,
                                      served_model, warm_up)
from compress.bench.serve.workload import BenchRequest


def _reqs(n, tokens=4):
    return [BenchRequest(tuple(range(i, i + 8)), tokens) for i in range(n)]


LONG_PROMPT = 50
# sent this much after its arrival time: late. Only gross delays fail (a schedule scaled
# or shifted); a busy 2-core machine can hold a send back for a few hundred ms.
LATE = 0.5


def _until_three_in_flight(server, request, i):
    """hold: tokens wait until three requests have been in flight at once, so the client's
    first three overlap however late one of them reaches the server."""
    return server.max_in_flight < 3


def _last_token_until_the_long_prompt(server, request, i):
    """hold: a running request's last token waits until the long prompt has come, so the
    running requests still decode when it comes however late it is sent."""
    return i == request["max_tokens"] - 1 and not any(len(r["prompt"]) == LONG_PROMPT for r in server.received)


def test_body_asks_for_exact_streamed_greedy_tokens():
    body = completion_body(BenchRequest((5, 6, 7), 9), Target("http://x", "m", extra_body={"top_k": 1}))
    assert body == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True, "top_k": 1}


def test_sampling_fields_replace_greedy():
    """--temperature / --top-p reach every request's body (greedy when not given)."""
    import argparse

    from compress.bench.serve.command import add_arguments, sampling_fields
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert sampling_fields(p.parse_args([])) == {}
    fields = sampling_fields(p.parse_args(["--temperature", "0.8", "--top-p", "0.95"]))
    assert fields == {"temperature": 0.8, "top_p": 0.95}
    body = completion_body(BenchRequest((5,), 3), Target("http://x", "m", extra_body={"logprobs": 0, **fields}))
    assert body["temperature"] == 0.8 and body["top_p"] == 0.95 and body["logprobs"] == 0
    from compress.errors import UserError
    for bad in (["--top-p", "0.9"], ["--temperature", "-1"], ["--temperature", "1", "--top-p", "0"]):
        with pytest.raises(UserError, match="--top-p|--temperature"):
            sampling_fields(p.parse_args(bad))


def test_concurrency_is_the_most_in_flight():
    with StubServer(token_delay=0.01, first_delay=0.01, hold=_until_three_in_flight) as server:
        target = Target(server.url, served_model(server.url))
        assert target.model == "stub-model"
        results = asyncio.run(run_concurrency(target, _reqs(9), concurrency=3))
        assert server.max_in_flight == 3
        assert [r.prompt_len for r in results] == [8] * 9 and all(r.ok and r.output_tokens == 4 for r in results)
        assert sorted(tuple(b["prompt"]) for b in server.received[:3]) == [r.prompt for r in _reqs(3)]
        assert asyncio.run(warm_up(target, tuple(range(40)))).ok
        assert server.received[-1]["prompt"] == list(range(16)) and server.received[-1]["max_tokens"] == 4


def test_arrivals_send_on_schedule():
    arrivals = [0.0, 0.15, 0.3]
    with StubServer(token_delay=0.001, first_delay=0.001) as server:
        start = time.perf_counter()     # before run_arrivals takes its own start
        results = asyncio.run(run_arrivals(Target(server.url), _reqs(3, tokens=2), arrivals))
        came = {tuple(b["prompt"]): b["at"] - start for b in server.received}
    assert all(r.ok for r in results)
    # each against the start, not against request 0, which a busy machine may delay alone
    for req, at, r in zip(_reqs(3), arrivals, results):
        assert came[req.prompt] >= at, ("sent before its time", came, arrivals)
        assert r.sent - start <= at + LATE, ("sent late", r.sent - start, arrivals)


def test_long_prompt_comes_after_the_running_first_tokens():
    reqs = [BenchRequest((1, 2, 3), 30, "running"), BenchRequest((4, 5), 30, "running"),
            BenchRequest(tuple(range(LONG_PROMPT)), 3, "long")]
    with StubServer(token_delay=0.01, first_delay=0.02, hold=_last_token_until_the_long_prompt) as server:
        results = asyncio.run(run_long_prompt(Target(server.url), reqs, long_after=0.05))
    running, long = results[:2], results[2]
    assert [r.role for r in results] == ["running", "running", "long"] and long.prompt_len == LONG_PROMPT
    assert all(r.ok for r in results)
    assert long.issued >= max(r.token_times[0] for r in running) + 0.05
    assert long.issued < min(r.token_times[-1] for r in running), "the others still decode when it comes"
