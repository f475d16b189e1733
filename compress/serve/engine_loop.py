"""The engine thread: the one thread that touches the runtime's engine.

The engine (``add_request`` / ``abort`` / ``step``) is not thread-safe, and a forward
pass must never run on the HTTP event loop. So the server owns one
:class:`EngineLoop` thread; HTTP handlers hand it commands through a thread-safe queue
(:meth:`EngineLoop.submit`, :meth:`abort`, :meth:`score`) and get results back on
their own asyncio queue (:class:`AsyncSink`, fed with ``loop.call_soon_threadsafe``).

The thread blocks on the command queue while the engine has nothing to do (no busy
spin); while it has work it takes every pending command, makes one engine step and
sends each request that progressed a :class:`Progress` (only the tokens new since
the last one). Prompt scoring (``echo`` with ``logprobs``) runs here too, between
steps, as one cache-free forward of the prompt. After every step it publishes a
snapshot of the engine's counters (:attr:`EngineLoop.stats`) that ``/metrics`` and the
tests read from other threads.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from compress.serve.logprobs import TokenLogprob, from_engine, prompt_logprobs

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0     # the generation rate /metrics reports is over this many seconds


def _describe(exc: BaseException, limit: int = 300) -> str:
    """One short line for an error body (an exception's text can hold whole tensors)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit] + " ..."


@dataclass
class Progress:
    """What one request gained in one step."""
    request_id: str
    new_token_ids: list[int]
    text: str                       # all generated text so far
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    new_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class ScoreResult:
    request_id: str
    logprobs: list[TokenLogprob]


@dataclass
class Failure:
    """A request that failed in the engine thread; ``status`` is the HTTP status."""
    request_id: str
    message: str
    status: int = 500


class AsyncSink:
    """Delivers items from the engine thread into an asyncio queue on ``loop``."""

    def __init__(self, loop, q):
        self.loop, self.queue = loop, q

    def __call__(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:   # the event loop is closed: nobody is listening any more
            pass


@dataclass
class _Live:
    sink: Callable[[Any], None]
    logprobs: int | None
    sent_tokens: int = 0


class EngineLoop:
    """Runs ``llm.engine`` on its own thread (start with :meth:`start`)."""

    def __init__(self, llm, name: str = "compress-engine"):
        self.llm = llm
        self.engine = llm.engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = threading.Event()
        self.error: BaseException | None = None
        self.generated_tokens = 0          # since start, every request
        self.steps = 0
        self._recent: deque[tuple[float, int]] = deque()   # (time, tokens) of the last RATE_WINDOW_S
        self.stats: dict = {}
        self._publish()

    # ------------------------------------------------------------- other threads
    def start(self) -> "EngineLoop":
        self.engine.check_owner("EngineLoop.start")   # one server's loop an engine
        self.engine.owner_thread = self._thread   # other threads' add_request / generate now refuse
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def submit(self, request_id: str, prompt_ids: list[int], params, sink, logprobs: int | None = None):
        self._commands.put(("add", request_id, prompt_ids, params, sink, logprobs))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def score(self, request_id: str, prompt_ids: list[int], top_k: int, sink) -> None:
        self._commands.put(("score", request_id, prompt_ids, top_k, sink))

    def request_stop(self) -> None:
        """Ask the thread to abort whatever is still in flight (each gets a 503) and end;
        returns at once."""
        self._commands.put(("stop",))

    def stop(self, timeout: float | None = 10.0) -> None:
        """:meth:`request_stop`, then wait for the thread to end."""
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def tokens_per_second(self) -> float:
        """Tokens generated per second over the last ``RATE_WINDOW_S`` seconds."""
        now = time.monotonic()
        return sum(n for t, n in list(self._recent) if now - t <= RATE_WINDOW_S) / RATE_WINDOW_S

    # ------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while True:
                if not self.engine.has_unfinished():     # idle: sleep until a command comes
                    if not self._handle(self._commands.get()):
                        return
                while True:
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(cmd):
                        return
                if self.engine.has_unfinished():
                    self._step()
                self._publish()
        except BaseException as exc:   # the loop must not die silently: fail what is in flight
            log.exception("engine loop crashed")
            self.error = exc
            self._fail_all(f"engine failure: {_describe(exc)}", 500)
        finally:
            self._stopped.set()
            self._publish()

    def _handle(self, cmd) -> bool:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt_ids, params, sink, logprobs = cmd
            try:
                self.engine.add_request(rid, prompt_ids, params)
            except ValueError as exc:
                sink(Failure(rid, str(exc), 400))
            except Exception as exc:   # noqa: BLE001 - answered as a 500, the loop goes on
                log.exception("add_request %s failed", rid)
                sink(Failure(rid, _describe(exc), 500))
            else:
                self._live[rid] = _Live(sink, logprobs)
        elif kind == "abort":
            rid = cmd[1]
            if self._live.pop(rid, None) is not None:
                self.engine.abort(rid)
        elif kind == "score":
            _, rid, prompt_ids, top_k, sink = cmd
            try:
                with torch.inference_mode():
                    hidden = self.llm.runner.hidden_states(torch.tensor([list(prompt_ids)]))[0]
                    scored = prompt_logprobs(hidden, prompt_ids, top_k, head=self.llm.model.logits)
                sink(ScoreResult(rid, scored))
            except Exception as exc:   # noqa: BLE001
                log.exception("scoring %s failed", rid)
                sink(Failure(rid, _describe(exc), 500))
        elif kind == "stop":
            self._fail_all("the server is shutting down", 503)
            return False
        return True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:   # noqa: BLE001 - every request in flight is failed, the loop goes on
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {_describe(exc)}", 500)
            return
        new_tokens = 0
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:           # aborted meanwhile
                continue
            token_ids = out.token_ids
            new_ids = [int(t) for t in token_ids[live.sent_tokens:]]
            new_lps = []
            if live.logprobs is not None:
                records = (out.logprobs or [])[live.sent_tokens:len(token_ids)]
                new_lps = [from_engine(t, r, live.logprobs) for t, r in zip(new_ids, records)]
            live.sent_tokens = len(token_ids)
            new_tokens += len(new_ids)
            live.sink(Progress(out.request_id, new_ids, out.text, bool(out.finished),
                               out.finish_reason if out.finished else None,
                               len(out.prompt_token_ids), new_lps))
            if out.finished:
                del self._live[out.request_id]
        self.generated_tokens += new_tokens
        self.steps += 1
        now = time.monotonic()
        self._recent.append((now, new_tokens))
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

    def _fail_all(self, message: str, status: int) -> None:
        for rid, live in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:   # noqa: BLE001 - best effort while failing
                log.exception("abort %s failed", rid)
            live.sink(Failure(rid, message, status))
        self._live.clear()

    def _publish(self) -> None:
        try:
            stats = dict(self.engine.stats())
        except Exception:   # noqa: BLE001 - a stats failure must not stop serving
            stats = {}
        stats.update(live_requests=len(self._live), generated_tokens=self.generated_tokens,
                     steps=self.steps)
        self.stats = stats     # one reference swap: readers on other threads see a whole dict
