"""The streaming client of `compress bench serve`: chunked decoding and SSE parsing at any
byte boundary, and timed requests against a real local SSE server."""
import asyncio
import json
import time

import pytest
from openai_stub_server import StubServer

from compress.bench.serve.client import (ChunkedDecoder, RequestResult, SSEParser, StreamProtocolError,
                                         handle_chunk, http_json, stream_completion)


def _chunked(pieces: list[bytes]) -> bytes:
    return b"".join(f"{len(p):x};ext=1\r\n".encode() + p + b"\r\n" for p in pieces) + b"0\r\n\r\n"


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_chunked_decoder_any_split(step):
    payload = [b"data: {\"a\": 1}\n\n", b"x" * 300, b"\r\n\r\n", b"tail"]
    wire = _chunked(payload)
    dec, out = ChunkedDecoder(), b""
    for i in range(0, len(wire), step):
        out += dec.feed(wire[i:i + step])
    assert out == b"".join(payload) and dec.done


def test_chunked_decoder_rejects_garbage():
    with pytest.raises(StreamProtocolError, match="chunk size"):
        ChunkedDecoder().feed(b"zz\r\nabc")
    with pytest.raises(StreamProtocolError, match="CRLF"):
        ChunkedDecoder().feed(b"3\r\nabcXY")


@pytest.mark.parametrize("step", [1, 2, 5, 4096])
@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
def test_sse_parser_any_split(step, eol):
    text = (f": a comment{eol}event: completion{eol}data: {{\"t\": \"é€\"}}{eol}{eol}"
            f"data: line one{eol}data:line two{eol}id: 7{eol}{eol}"
            f"data: [DONE]{eol}{eol}")
    wire = text.encode()
    parser, events = SSEParser(), []
    for i in range(0, len(wire), step):
        events += parser.feed(wire[i:i + step])
    assert events == ['{"t": "é€"}', "line one\nline two", "[DONE]"]


def test_sse_parser_waits_for_the_blank_line():
    parser = SSEParser()
    assert parser.feed(b"data: 1\n") == []
    assert parser.feed(b"\n") == ["1"]


def test_handle_chunk_counts_tokens_like_the_servers_send_them():
    r = RequestResult(prompt_len=4, max_tokens=3)
    assert not handle_chunk(r, json.dumps({"choices": [{"text": "a", "finish_reason": None}]}), 1.0)
    # a token whose text is empty (a special token): still a token, finish_reason is null
    assert not handle_chunk(r, json.dumps({"choices": [{"text": "", "finish_reason": None}]}), 2.0)
    # a last token that carries its finish_reason and text (one chunk) is a token
    assert not handle_chunk(r, json.dumps({"choices": [{"text": "c", "finish_reason": "length"}]}), 3.0)
    # llama-server's closing chunk: empty text, finish_reason, usage: not a token
    assert not handle_chunk(r, json.dumps({"choices": [{"text": "", "finish_reason": "length"}],
                                           "usage": {"completion_tokens": 3}}), 4.0)
    assert handle_chunk(r, "[DONE]", 5.0)
    assert r.token_times == [1.0, 2.0, 3.0] and r.finish_reason == "length" and r.reported_tokens == 3
    assert handle_chunk(r, json.dumps({"error": {"message": "boom"}}), 6.0) and "boom" in r.error


@pytest.mark.parametrize("mode", [dict(chunked=True), dict(chunked=False), dict(crlf=True, split=True)])
def test_stream_completion_times_every_token(mode):
    r = RequestResult(prompt_len=3, max_tokens=6, issued=time.perf_counter())

    def paced_by_the_client(server, request, i):
        # token i leaves token_delay after the client has timed token i - 1, so every gap it
        # measures is at least that even when it reads late (two tokens then came in one read)
        return len(r.token_times) < i

    with StubServer(token_delay=0.02, first_delay=0.05, hold=paced_by_the_client, **mode) as server:
        firsts = []
        asyncio.run(stream_completion(server.url + "/v1/completions",
                                      {"prompt": [1, 2, 3], "max_tokens": 6, "stream": True}, r,
                                      on_first_token=lambda: firsts.append(time.perf_counter())))
    assert r.error is None and r.ok
    assert len(r.token_times) == 6 and r.output_tokens == 6 and r.reported_tokens == 6
    assert len(firsts) == 1 and firsts[0] >= r.token_times[0]
    assert r.ttft >= 0.045, "the first token comes after the server's first delay"
    assert all(g >= 0.015 for g in r.itls), r.itls   # the server sleeps 20 ms between tokens
    assert r.tpot == pytest.approx((r.end - r.token_times[0]) / 5)
    assert r.end >= r.token_times[-1] and server.received[0]["prompt"] == [1, 2, 3]


def test_stream_completion_records_http_errors_and_timeouts():
    with StubServer(max_tokens_limit=4, first_delay=1.0) as server:
        bad = asyncio.run(stream_completion(server.url + "/v1/completions", {"prompt": [1], "max_tokens": 9},
                                            RequestResult(1, 9)))
        slow = asyncio.run(stream_completion(server.url + "/v1/completions", {"prompt": [1], "max_tokens": 2},
                                             RequestResult(1, 2), timeout=0.2))
    assert not bad.ok and bad.error.startswith("HTTP 400") and "max_tokens 9 too large" in bad.error
    assert not slow.ok and "within 0.2 s" in slow.error
    gone = asyncio.run(stream_completion("http://127.0.0.1:9/v1/completions", {}, RequestResult(1, 1)))
    assert not gone.ok and gone.error


def test_http_json():
    with StubServer() as server:
        assert http_json(server.url + "/health") == (200, {"status": "ok"})
        status, body = http_json(server.url + "/tokenize", {"prompt": "ab c"})
        assert status == 200 and body == {"tokens": [2, 1]}
        assert http_json(server.url + "/nope")[0] == 404
    assert http_json("http://127.0.0.1:9/health", timeout=1.0) == (0, None)
