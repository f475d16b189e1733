"""One HTTP request's sequences in the engine, seen from the event loop.

A :class:`Generation` hands the engine thread its prompts (one sequence each, or a
scoring pass) and yields what comes back, tagged with the prompt's index. It enforces the
request's deadline and watches its client: a timeout raises a 504 :class:`APIError`, a
client that went away raises :class:`ClientGone`; either way, and on any other exit,
:meth:`close` aborts every sequence still running, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import time

from compress.serve.engine_loop import AsyncSink, Failure, Progress, ScoreResult
from compress.serve.protocol import APIError


FAILURE_CODES = {400: "invalid_prompt", 500: "engine_error", 503: "server_shutting_down"}


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


class Generation:
    def __init__(self, state, prefix: str, count: int, request=None, watch_disconnect: bool = True):
        self.state = state
        self.loop = state.engine_loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sink = AsyncSink(asyncio.get_running_loop(), self.queue)
        self.ids = [f"{prefix}-{i}" for i in range(count)]
        self._index = {rid: i for i, rid in enumerate(self.ids)}
        self.running: set[str] = set()
        timeout = state.config.request_timeout
        self.deadline = time.monotonic() + timeout if timeout else None
        self.request = request if watch_disconnect else None
        self._next_poll = time.monotonic() + state.config.disconnect_poll_s

    # ------------------------------------------------------------------ commands
    def start(self, index: int, prompt_ids: list[int], params, logprobs: int | None = None) -> None:
        rid = self.ids[index]
        self.running.add(rid)
        self.loop.submit(rid, prompt_ids, params, self.sink, logprobs)

    def score(self, index: int, prompt_ids: list[int], top_k: int) -> None:
        self.loop.score(self.ids[index], prompt_ids, top_k, self.sink)

    def close(self) -> None:
        """Abort every sequence that has not finished (idempotent)."""
        for rid in self.running:
            self.loop.abort(rid)
        self.running.clear()

    # ------------------------------------------------------------------ results
    async def next(self) -> tuple[int, Progress | ScoreResult]:
        """The next result as ``(prompt index, item)``; a :class:`Failure` is raised as an
        :class:`APIError` with the engine's status. Checks the client every
        ``disconnect_poll_s`` whether results keep coming or not."""
        poll = self.state.config.disconnect_poll_s
        while True:
            now = time.monotonic()
            if self.request is not None and now >= self._next_poll:
                self._next_poll = now + poll
                if await self.request.is_disconnected():
                    self.state.disconnected += 1
                    raise ClientGone()
            wait = self._next_poll - now if self.request is not None else None
            if self.deadline is not None:
                left = self.deadline - now
                if left <= 0:
                    self.state.timed_out += 1
                    raise APIError(f"the request did not finish within its timeout of "
                                   f"{self.state.config.request_timeout:g} s", status=504,
                                   type="timeout_error", code="request_timeout")
                wait = left if wait is None else min(wait, left)
            try:
                item = await asyncio.wait_for(self.queue.get(), max(wait, 0.0) if wait is not None else None)
            except asyncio.TimeoutError:
                continue
            index = self._index.get(item.request_id)
            if index is None:
                continue
            if isinstance(item, Failure):
                self.running.discard(item.request_id)
                raise APIError(item.message, status=item.status,
                               type="invalid_request_error" if item.status == 400 else "server_error",
                               param="prompt" if item.status == 400 else None,
                               code=FAILURE_CODES.get(item.status))
            if isinstance(item, Progress) and item.finished:
                self.running.discard(item.request_id)
            return index, item

    async def scores(self, indices: list[int]) -> dict[int, ScoreResult]:
        """Wait for the scoring passes of ``indices`` (started with :meth:`score`)."""
        got: dict[int, ScoreResult] = {}
        while len(got) < len(indices):
            index, item = await self.next()
            if isinstance(item, ScoreResult):
                got[index] = item
        return got
