"""Sending a workload to one server: fixed concurrency (closed loop: every request is
ready at the start, at most C in flight), Poisson arrivals (open loop, optionally
capped), or the long-prompt scenario. Each request's clock starts when the client sends
it, as in ``vllm bench serve``; queueing inside the server counts."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Sequence

from compress.bench.serve.client import RequestResult, http_json, stream_completion
from compress.bench.serve.workload import BenchRequest


@dataclass
class Target:
    """A running OpenAI-compatible server: its base URL (``http://host:port``), the
    model name it serves, extra request headers and extra body fields."""
    base_url: str
    model: str = "default"
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)
    timeout: float = 600.0

    @property
    def completions_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/completions"


def served_model(base_url: str, headers: dict[str, str] | None = None) -> str | None:
    """The first model id of ``GET /v1/models``, or None."""
    status, body = http_json(base_url.rstrip("/") + "/v1/models", headers=headers)
    if status == 200 and isinstance(body, dict) and body.get("data"):
        return str(body["data"][0].get("id"))
    return None


def completion_body(req: BenchRequest, target: Target) -> dict:
    """The streamed ``/v1/completions`` body of ``req``: the prompt as token ids, exactly
    ``max_tokens`` tokens (``ignore_eos``), usage in the last chunk; greedy unless the
    target's extra fields (``--temperature`` / ``--top-p``, a peer's own) say otherwise."""
    body = {"model": target.model, "prompt": list(req.prompt), "max_tokens": req.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    body.update(target.extra_body)
    return body


async def _send(target: Target, req: BenchRequest, on_first_token=None) -> RequestResult:
    result = RequestResult(prompt_len=len(req.prompt), max_tokens=req.max_tokens, role=req.role,
                           issued=time.perf_counter())
    return await stream_completion(target.completions_url, completion_body(req, target), result,
                                   headers=target.headers, timeout=target.timeout, on_first_token=on_first_token)


async def run_concurrency(target: Target, requests: Sequence[BenchRequest], concurrency: int) -> list[RequestResult]:
    """All requests ready at once, at most ``concurrency`` in flight, sent in order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(req):
        async with gate:
            return await _send(target, req)
    return list(await asyncio.gather(*(one(r) for r in requests)))


async def run_arrivals(target: Target, requests: Sequence[BenchRequest], arrivals: Sequence[float],
                       max_concurrency: int | None = None) -> list[RequestResult]:
    """Request i sent ``arrivals[i]`` seconds after the start (and, with
    ``max_concurrency``, once fewer than that are in flight)."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(req, at):
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        if gate is None:
            return await _send(target, req)
        async with gate:
            return await _send(target, req)
    return list(await asyncio.gather(*(one(r, a) for r, a in zip(requests, arrivals))))


async def run_long_prompt(target: Target, requests: Sequence[BenchRequest], long_after: float) -> list[RequestResult]:
    """The ``running`` requests sent at once; ``long_after`` seconds after the last of
    them has its first token, the ``long`` request."""
    running = [r for r in requests if r.role == "running"]
    longs = [r for r in requests if r.role == "long"]
    started = [asyncio.Event() for _ in running]
    tasks = [asyncio.ensure_future(_send(target, r, on_first_token=e.set)) for r, e in zip(running, started)]

    async def all_started():
        await asyncio.gather(*(e.wait() for e in started))
    waiter = asyncio.ensure_future(all_started())
    # a running request that fails never sets its event: stop waiting when all are done
    await asyncio.wait([waiter, asyncio.ensure_future(asyncio.gather(*tasks))], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    await asyncio.sleep(long_after)
    tasks += [asyncio.ensure_future(_send(target, r)) for r in longs]
    return list(await asyncio.gather(*tasks))


async def warm_up(target: Target, prompt: Sequence[int]) -> RequestResult:
    """One short untimed request (16 prompt tokens, 4 new), so that first-call costs
    (allocation, page faults, lazy kernels) stay out of the figures."""
    return await _send(target, BenchRequest(tuple(prompt[:16]), 4))
