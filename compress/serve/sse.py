"""Server-sent events as OpenAI streams them, and the text a stream may release.

Each event is ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``.
:class:`StopHoldback` keeps back the last characters of the generated text that could be
the start of a stop string, so no streamed delta ever has to be taken back when the
engine cuts the text at a stop string.
:class:`EventStreamResponse` always closes its event generator when the response ends,
however it ends (finished, failed, or the client gone), so the generator's ``finally``
aborts the request at once instead of whenever the generator is collected.
"""
from __future__ import annotations

import json

from starlette.responses import StreamingResponse

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


class StopHoldback:
    def __init__(self, stops: list[str]):
        self.keep = max((len(s) for s in stops if s), default=1) - 1
        self.sent = 0

    def release(self, text: str, finished: bool) -> str:
        """The new part of ``text`` (all generated text so far) that is safe to send."""
        end = len(text) if finished else max(self.sent, len(text) - self.keep)
        delta = text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta


class GuardedStream:
    """An async iterator of events whose ``cleanup`` runs exactly once when it is closed,
    exhausted or fails -- also when it was never started (an async generator that never
    ran skips its own ``finally`` on ``aclose``)."""

    def __init__(self, events, cleanup):
        self.events, self._cleanup = events, cleanup

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self.events.__anext__()
        except BaseException:
            self.cleanup()
            raise

    def cleanup(self) -> None:
        if self._cleanup is not None:
            cleanup, self._cleanup = self._cleanup, None
            cleanup()

    async def aclose(self) -> None:
        try:
            await self.events.aclose()
        finally:
            self.cleanup()


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content, **kwargs):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, headers=headers, **kwargs)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
