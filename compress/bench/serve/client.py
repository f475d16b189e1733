"""An asyncio streaming client for OpenAI-compatible ``/v1/completions`` that times every
chunk as its bytes arrive.

Plain HTTP/1.1 over ``asyncio.open_connection`` (one connection per request, as
``vllm bench serve`` opens one session per request): no client library sits between the
socket and the clock. The body is read as it comes (chunked transfer encoding or not)
and split into server-sent events; each ``data:`` event is one completion chunk.

What counts as a token: a chunk whose ``finish_reason`` is still null (servers send one
per generated token) or that carries text. The final chunk of llama-server has empty
text, a ``finish_reason`` and the ``usage``; it closes the request but is no token. The
number of output tokens is ``usage.completion_tokens`` when the server reports it, else
the number of token chunks. A chunk that holds several tokens (a server that holds back
an incomplete UTF-8 character) counts as one inter-token gap, as in vLLM's benchmark."""
from __future__ import annotations

import asyncio
import codecs
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlsplit


class StreamProtocolError(Exception):
    """The server's reply is not HTTP/1.1 with server-sent events as expected."""


class ChunkedDecoder:
    """Incremental decoder of HTTP/1.1 chunked transfer encoding: ``feed(bytes)``
    returns the payload bytes complete so far; ``done`` once the last (empty) chunk and
    its trailer have been read."""

    def __init__(self) -> None:
        self._buf = b""
        self._need = -1      # bytes of the current chunk still to read; -1: a size line comes next
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = bytearray()
        while not self.done:
            if self._need < 0:
                end = self._buf.find(b"\r\n")
                if end < 0:
                    break
                size_text = self._buf[:end].split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise StreamProtocolError(f"bad chunk size line {self._buf[:end][:40]!r}") from None
                self._buf = self._buf[end + 2:]
                if size == 0:
                    self.done = True   # trailer headers, if any, are not needed
                    break
                self._need = size
            if len(self._buf) < self._need + 2:
                take = min(len(self._buf), self._need)
                out += self._buf[:take]
                self._buf = self._buf[take:]
                self._need -= take
                if self._need > 0 or len(self._buf) < 2:
                    break
            out += self._buf[:self._need]
            if self._buf[self._need:self._need + 2] != b"\r\n":
                raise StreamProtocolError("a chunk does not end with CRLF")
            self._buf = self._buf[self._need + 2:]
            self._need = -1
        return bytes(out)


class SSEParser:
    """Incremental parser of server-sent events: ``feed(bytes)`` returns the ``data``
    of every event completed so far (multi-line data joined with newlines; comments,
    ``event:`` / ``id:`` / ``retry:`` fields ignored; LF, CRLF or CR line ends)."""

    def __init__(self) -> None:
        self._buf = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._data: list[str] = []
        self._skip_lf = False   # the last line ended with CR at the end of a feed: an LF may follow

    def feed(self, data: bytes) -> list[str]:
        self._buf += self._decoder.decode(data)
        events = []
        while self._buf:
            if self._skip_lf:
                self._skip_lf = False
                if self._buf[0] == "\n":
                    self._buf = self._buf[1:]
                    continue
            cr, lf = self._buf.find("\r"), self._buf.find("\n")
            cut = min(i for i in (cr, lf) if i >= 0) if max(cr, lf) >= 0 else -1
            if cut < 0:
                break
            line = self._buf[:cut]
            if self._buf[cut] == "\r" and cut + 1 == len(self._buf):
                self._skip_lf = True
            step = 2 if self._buf.startswith("\r\n", cut) else 1
            self._buf = self._buf[cut + step:]
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif not line.startswith(":"):
                name, _, value = line.partition(":")
                if name == "data":
                    self._data.append(value[1:] if value.startswith(" ") else value)
        return events


@dataclass
class RequestResult:
    """One streamed request, timed with ``time.perf_counter``: when it was issued
    (``issued``: it entered the client's queue), sent, each token chunk's arrival, the
    end of the stream; the output tokens (reported or counted) and any error."""
    prompt_len: int
    max_tokens: int
    role: str = "request"
    issued: float = 0.0
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    output_tokens: int = 0
    reported_tokens: int | None = None   # usage.completion_tokens, when the server gave it
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens > 0

    @property
    def ttft(self) -> float | None:
        """Seconds from issue to the first token chunk; None when no chunk carried a token
        (a server that sent all its tokens' text at the end)."""
        return self.token_times[0] - self.issued if self.token_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.issued

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first; None with one token."""
        if self.output_tokens < 2 or not self.token_times:
            return None
        return (self.end - self.token_times[0]) / (self.output_tokens - 1)


def _request_bytes(host: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             "Accept: text/event-stream", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = (await reader.readline()).decode("latin-1").strip()
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise StreamProtocolError(f"not an HTTP status line: {status_line[:80]!r}")
    headers = {}
    while True:
        line = (await reader.readline()).decode("latin-1")
        if line in ("\r\n", "\n", ""):
            break
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(parts[1]), headers


def handle_chunk(result: RequestResult, payload: str, now: float) -> bool:
    """Fold one SSE ``data`` payload into ``result``; True at ``[DONE]``."""
    if payload.strip() == "[DONE]":
        return True
    try:
        chunk = json.loads(payload)
    except ValueError:
        raise StreamProtocolError(f"an event's data is not JSON: {payload[:120]!r}") from None
    if "error" in chunk:
        result.error = f"server error in stream: {json.dumps(chunk['error'])[:300]}"
        return True
    choices = chunk.get("choices") or []
    if choices:
        choice = choices[0]
        text = choice.get("text") or ""
        finish = choice.get("finish_reason")
        if finish is None or text:
            result.token_times.append(now)
        if finish is not None:
            result.finish_reason = finish
    usage = chunk.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        result.reported_tokens = int(usage["completion_tokens"])
    return False


async def _exchange(host: str, port: int, path: str, payload: bytes, headers: dict[str, str],
                    result: RequestResult, on_first_token) -> None:
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_request_bytes(host, port, path, payload, headers))
        await writer.drain()
        status, head = await _read_head(reader)
        chunked = "chunked" in head.get("transfer-encoding", "").lower()
        if status != 200:
            raw = await reader.read()
            text = (ChunkedDecoder().feed(raw) if chunked else raw).decode("utf-8", "replace")
            result.error = f"HTTP {status}: {text.strip()[:300]}"
            return
        dechunk, sse, finished = ChunkedDecoder() if chunked else None, SSEParser(), False
        while not finished:
            data = await reader.read(65536)
            now = time.perf_counter()
            if not data:
                break
            for event in sse.feed(dechunk.feed(data) if dechunk else data):
                had_token = bool(result.token_times)
                finished = handle_chunk(result, event, now)
                if not had_token and result.token_times and on_first_token is not None:
                    on_first_token()
                if finished:
                    break
            if dechunk is not None and dechunk.done:
                break
        result.end = time.perf_counter()
        if not finished and result.error is None:
            result.error = "stream ended without [DONE]"
    finally:
        if writer is not None:
            writer.close()


async def stream_completion(url: str, body: dict, result: RequestResult, headers: dict[str, str] | None = None,
                            timeout: float = 600.0, on_first_token=None) -> RequestResult:
    """POST ``body`` (with ``stream: true``) to ``url`` and fill ``result`` with the
    timing of each chunk. Errors (HTTP status, broken stream, timeout) are recorded in
    ``result.error``, never raised. ``on_first_token()`` is called at the first token."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    result.sent = time.perf_counter()
    try:
        await asyncio.wait_for(_exchange(host, port, path, json.dumps(body).encode(), headers or {}, result,
                                         on_first_token), timeout)
    except asyncio.TimeoutError:
        result.error = f"no complete answer within {timeout:g} s"
    except (OSError, StreamProtocolError, asyncio.IncompleteReadError) as e:
        result.error = f"{type(e).__name__}: {e}"
    if not result.end:
        result.end = time.perf_counter()
    result.output_tokens = result.reported_tokens if result.reported_tokens is not None else len(result.token_times)
    if result.error is None and result.output_tokens == 0:
        result.error = "the stream held no token"
    return result


# ---------------------------------------------------------------- plain JSON calls
def http_json(url: str, body: dict | None = None, timeout: float = 10.0,
              headers: dict[str, str] | None = None) -> tuple[int, object]:
    """(status, decoded JSON or text) of a GET (``body`` None) or JSON POST; status 0
    when nothing answers."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (OSError, ValueError):
        return 0, None
    text = raw.decode("utf-8", "replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text
