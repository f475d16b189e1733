"""Running the server: the model, the engine thread, uvicorn, and a clean SIGTERM.

:func:`serve` is what ``compress serve`` runs in the foreground. SIGTERM (or Ctrl-C)
makes uvicorn stop accepting connections; the requests in flight get ``shutdown_grace``
seconds to finish (new requests on open connections get 503). Then the engine thread is
stopped, which aborts every sequence still running and answers its request as an
OpenAI-style 503 (a stream gets an error event and ``[DONE]``), so every client hears why;
uvicorn cancels whatever is still open a few seconds later (a backstop), and the process
exits 0.

:class:`ServerThread` runs the same application on a thread of the calling process, for
tests and scripts. Both listen on a socket bound before the model loads
(:func:`listen_socket`): port 0 takes any free port, and ``compress serve`` prints the one it
got (:func:`listening_line`, read back by :func:`url_in_log`), so a script that starts it
needs no port picked beforehand, which another process could take in between.
"""
from __future__ import annotations

import asyncio
import logging
import re
import signal
import socket
import threading
import time

import uvicorn

from compress.serve.app import build_app
from compress.serve.engine_loop import EngineLoop
from compress.serve.state import ServeConfig, ServerState

log = logging.getLogger(__name__)


def make_app(llm, config: ServeConfig):
    """``(asgi_app, state)`` over ``llm`` with a started engine thread; the thread stops at
    the end of the application's lifespan."""
    running = getattr(getattr(llm.engine, "scheduler", None), "max_num_seqs", None)
    if running:                      # the queue bound counts beyond what the engine really runs
        config.max_num_seqs = int(running)
    engine_loop = EngineLoop(llm).start()
    state = ServerState(config, llm, engine_loop)
    return build_app(state, on_shutdown=engine_loop.stop), state


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: any free port), not yet listening; an address
    that cannot be bound is a ``UserError`` naming it."""
    from compress.errors import UserError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so (else Nagle
    # and delayed ACKs add ~40 ms to every keep-alive request)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} (--host / --port): {exc.strerror or exc}") from None
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


_URL_IN_LINE = re.compile(r"^compress serve: .* on (http://\S+?)(?: \(|$)", re.MULTILINE)


def listening_line(model_name: str, path: str, url: str, notes: str = "") -> str:
    """The line ``compress serve`` prints once its socket is bound (``url_in_log`` reads it)."""
    return f"compress serve: {model_name} ({path}) on {url}{notes}"


def url_in_log(text: str) -> str | None:
    """The URL of the first ``listening_line`` in ``text`` (a server's output), or None."""
    m = _URL_IN_LINE.search(text)
    return m.group(1) if m else None


BACKSTOP_S = 5.0    # after the grace period and the engine's aborts, uvicorn cancels what is left


def _uvicorn_config(app, host: str, port: int, shutdown_grace: float, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, lifespan="on", log_level=log_level,
                          timeout_graceful_shutdown=shutdown_grace + BACKSTOP_S,
                          access_log=log_level == "debug")


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown first drains: new requests are refused, and after
    ``shutdown_grace`` seconds the engine thread aborts what is still running."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_grace: float):
        super().__init__(config)
        self.state, self.shutdown_grace = state, shutdown_grace

    async def shutdown(self, sockets=None) -> None:
        self.state.draining = True
        timer = asyncio.get_running_loop().call_later(self.shutdown_grace, self.state.engine_loop.request_stop)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def serve(llm, config: ServeConfig, sock: socket.socket, shutdown_grace: float = 30.0,
          log_level: str = "info") -> int:
    """Serves ``llm`` on ``sock`` (from :func:`listen_socket`) until SIGTERM; the engine
    steps on its own thread, so build ``llm`` on a thread that exits
    (``runtime.threads.run_on_fresh_thread``, as ``compress serve`` does): an OpenMP pool
    left on this thread makes every op of the engine's wait."""
    app, state = make_app(llm, config)
    host, port = sock.getsockname()[:2]
    server = DrainingServer(_uvicorn_config(app, host, port, shutdown_grace, log_level), state, shutdown_grace)
    # uvicorn re-raises the signal that stopped it once it has shut down; with the default
    # handler that would end the process "killed by SIGTERM". Ours makes that a no-op, so a
    # drained server exits 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        state.engine_loop.stop()
    return 0 if state.engine_loop.error is None else 1


class ServerThread:
    """``compress serve`` inside this process, on a background thread::

        with ServerThread(llm, ServeConfig(model_name="m")) as srv:
            requests.get(srv.url + "/health")
    """

    def __init__(self, llm, config: ServeConfig, host: str = "127.0.0.1", port: int = 0,
                 shutdown_grace: float = 5.0, log_level: str = "warning"):
        self.sock = listen_socket(host, port)
        self.app, self.state = make_app(llm, config)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = DrainingServer(_uvicorn_config(self.app, host, self.port, shutdown_grace, log_level),
                                     self.state, shutdown_grace)
        self._thread = threading.Thread(target=self._run, name="compress-serve-http", daemon=True)

    @property
    def url(self) -> str:
        return socket_url(self.sock)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.state.engine_loop.stop()
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
