"""A small real HTTP server that streams OpenAI-style completions as server-sent events,
for the tests of ``compress bench serve`` (no model: each "token" is a fixed sleep).

``POST /v1/completions`` streams ``max_tokens`` chunks ``token_delay`` seconds apart
(the first after ``first_delay``), then llama-server's closing shape: a chunk with empty
text, ``finish_reason: "length"`` and ``usage``, then ``data: [DONE]``. Options (server
attributes): ``chunked`` transfer encoding or a body delimited by closing the
connection; ``crlf`` event line ends; ``split`` writes each event in two pieces;
``max_tokens_limit`` answers larger requests with 400 and an OpenAI error body;
``hold(server, request, i)``: token ``i`` of the stream answering ``request`` (its
record in ``received``) waits while this is true, so that a test orders events by a
condition rather than by sleeps (see ``HOLD_TIMEOUT``).
It records what it was sent (with the time it came and the ``/metrics`` reads before
it), the most requests it served at once and the ``/metrics`` reads.

Run as a script (``python openai_stub_server.py PORT``) it serves until SIGTERM."""
from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The most a stream waits on its holds, all together: a hold whose condition never comes
# (the behaviour under test is broken) ends the server's holds, and the test fails on its
# own check instead of hanging.
HOLD_TIMEOUT = 5.0
HOLD_POLL = 0.002


class StubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})
        elif self.path == "/metrics" and self.server.kv_metrics:
            # as compress serve's gauges: each request in flight holds 3 slots past its tokens
            with self.server.lock:
                running = self.server.in_flight
                self.server.metrics_reads += 1   # with its figure: a read after a request came counts it
            data = (f"compress_requests_running {running}\ncompress_kv_slots_reserved_unused {3 * running}\n"
                    f"compress_kv_blocks_used {2 * running}\ncompress_kv_block_size 16\n").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._json(404, {"error": {"message": "not found"}})

    def _write(self, data: bytes) -> None:
        srv = self.server
        if srv.chunked:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        else:
            self.wfile.write(data)
        self.wfile.flush()

    def _event(self, obj) -> None:
        end = "\r\n" if self.server.crlf else "\n"
        text = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}{end}{end}".encode()
        if self.server.split:
            cut = len(text) // 2
            self._write(text[:cut])
            time.sleep(0.002)
            self._write(text[cut:])
        else:
            self._write(text)

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/tokenize":
            self._json(200, {"tokens": [len(w) for w in str(body.get("prompt", "")).split()]})
            return
        if self.path != "/v1/completions":
            self._json(404, {"error": {"message": "not found"}})
            return
        n = int(body.get("max_tokens", 16))
        if srv.max_tokens_limit is not None and n > srv.max_tokens_limit:
            self._json(400, {"error": {"message": f"max_tokens {n} too large", "type": "invalid_request_error",
                                       "param": "max_tokens"}})
            return
        with srv.lock:
            request = {"at": time.perf_counter(), "metrics_reads": srv.metrics_reads, **body}
            srv.received.append(request)
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        counted = True

        def leave():    # before [DONE]: a client that has read it may send its next request at once
            nonlocal counted
            if counted:
                counted = False
                with srv.lock:
                    srv.in_flight -= 1
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            if srv.chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Connection", "close")
            self.end_headers()
            time.sleep(srv.first_delay)
            held_until = time.monotonic() + HOLD_TIMEOUT
            for i in range(n):
                self._wait_while_held(request, i, held_until)
                if i:
                    time.sleep(srv.token_delay)
                self._event({"choices": [{"text": f" t{i}", "index": 0, "finish_reason": None}],
                             "object": "text_completion"})
            self._event({"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                         "usage": {"prompt_tokens": len(body.get("prompt", [])), "completion_tokens": n}})
            leave()
            self._event("[DONE]")
            if srv.chunked:
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.close_connection = True
        finally:
            leave()

    def _wait_while_held(self, request: dict, i: int, until: float) -> None:
        srv = self.server
        while srv.hold is not None and srv.hold(srv, request, i):
            if time.monotonic() > until:
                srv.hold = None    # its condition never came: the rest goes unheld, and fails the test soon
                return
            time.sleep(HOLD_POLL)


class StubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0, token_delay: float = 0.01, first_delay: float = 0.02, chunked: bool = True,
                 crlf: bool = False, split: bool = False, max_tokens_limit: int | None = None,
                 kv_metrics: bool = False, hold=None):
        super().__init__(("127.0.0.1", port), StubHandler)
        self.token_delay, self.first_delay = token_delay, first_delay
        self.chunked, self.crlf, self.split = chunked, crlf, split
        self.max_tokens_limit = max_tokens_limit
        self.kv_metrics = kv_metrics  # serve compress's KV gauges at /metrics
        self.hold = hold              # (server, request, token index) -> that token waits
        self.lock = threading.Lock()
        self.received: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.metrics_reads = 0

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):   # a client that left
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


if __name__ == "__main__":
    import signal

    from compress.serve.server import listening_line

    server = StubServer(int(sys.argv[1]))   # 0: any free port, named as compress serve names its own
    print(listening_line("stub", __file__, server.url), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()
    server.server_close()
