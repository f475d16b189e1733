"""The servers that ``compress bench serve`` compares, each started as a subprocess on a
free loopback port and stopped after its runs (ours on port 0, read back from the line it
prints; llama-server on a port picked just before):

* ``ours``: ``compress serve MODEL`` (continuous batching, the engine's defaults);
* ``ours-serial``: the same server admitting one sequence at a time
  (``--max-num-seqs 1``): our engine without continuous batching;
* ``ours-no-prefix-cache``, ``ours-no-chunking``: ours without prefix caching, without
  chunked prefill (the baselines of the shared-prefix and long-prompt workloads);
* ``llamacpp``: llama.cpp's ``llama-server`` (built by ``compress bench llamacpp``) on the
  same weights as GGUF, with continuous batching over ``slots`` parallel slots, each
  slot ``ctx_per_slot`` tokens of context (``-c`` is their total).

All get the same thread count. How each is started is data (``PEERS``): a function
from the settings to the command line, and the extra fields its requests carry. A server already running elsewhere is a
``url`` peer (``--url NAME=URL``): nothing is started or stopped."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from compress.bench.serve.client import http_json
from compress.errors import UserError


class PeerError(UserError):
    """A peer that could not be started or did not become ready (names it and its log)."""


@dataclass
class PeerSettings:
    """What the peers are started with."""
    model: str                   # our export (ours, ours-serial)
    threads: int = 2
    slots: int = 16              # llama-server -np
    ctx_per_slot: int = 2048     # llama-server: -c = slots * ctx_per_slot (it caps a slot at the trained context)
    gguf: str | None = None      # llama-server's weights (made by the command from --hf)
    ours_args: list[str] = field(default_factory=list)   # extra `compress serve` arguments
    llamacpp_args: list[str] = field(default_factory=list)  # extra llama-server arguments
    llamacpp_dir: str | None = None   # where `compress bench llamacpp` keeps its tools.json


def _ours(s: PeerSettings, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "compress.cli", "serve", s.model, "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(s.threads), *extra, *s.ours_args]


def _ours_kind(extra: list[str], about: str) -> "PeerKind":
    return PeerKind(lambda s, port: _ours(s, port, extra), about, OURS_BODY, port_in_log=True)


# llama-server's flash attention (``-fa auto`` turns it on for the CPU) decoded one
# request 4 to 10x slower with 16 slots of 2,048 tokens than without it (0.8-2.1 against
# 8-9 tok/s, 345M Q4_0, 2 threads; with one slot both ran at 9-10 tok/s): the peer runs
# without it, its faster setting here. Override with --llamacpp-arg.
def _llamacpp(s: PeerSettings, port: int) -> list[str]:
    from compress.bench.llamacpp import load_tools

    if not s.gguf:
        raise PeerError("peer llamacpp: no GGUF weights (give --hf DIR, the dense source of the export, "
                        "or --gguf FILE)")
    server = load_tools(s.llamacpp_dir).tools.get("llama-server")
    if not server or not Path(server).is_file():
        raise PeerError("peer llamacpp: llama-server is not built: run `compress bench llamacpp`")
    return [server, "-m", s.gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(s.threads),
            "-tb", str(s.threads), "-np", str(s.slots), "-c", str(s.slots * s.ctx_per_slot), "--cont-batching",
            "-b", "2048", "-ub", "512", "-fa", "off", "-fit", "off", "--no-webui", *s.llamacpp_args]


@dataclass(frozen=True)
class PeerKind:
    """How a peer is started (``command(settings, port)``), what it is, and the extra
    fields every request to it carries."""
    command: Callable[[PeerSettings, int], list[str]]
    about: str
    body: dict = field(default_factory=dict)
    port_in_log: bool = False   # started on port 0; its URL is read from its output (serve.server.url_in_log)


# `compress serve` streams a chunk only for tokens that add text; ids past the bench
# model's tokenizer (4,096 of its 32,000) add none, so without per-token logprobs most
# tokens would reach the client late, in the next chunk with text. logprobs=0 makes it
# send one chunk per token (the sampled token's logprob: one log_softmax per token).
OURS_BODY = {"logprobs": 0}

PEERS: dict[str, PeerKind] = {
    "ours": _ours_kind([], "compress serve (continuous batching)"),
    "ours-serial": _ours_kind(["--max-num-seqs", "1"], "compress serve, one sequence at a time (no continuous batching)"),
    "ours-no-prefix-cache": _ours_kind(["--no-prefix-caching"], "compress serve without prefix caching"),
    "ours-no-chunking": _ours_kind(["--no-chunked-prefill"], "compress serve without chunked prefill"),
    # llama-server streams every token (empty text included), so it needs no extra field
    "llamacpp": PeerKind(_llamacpp, "llama.cpp llama-server, parallel slots with continuous batching"),
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class RunningPeer:
    """A peer's server: started by :meth:`start` (waits for ``/health``), stopped by
    :meth:`stop` (SIGTERM, then SIGKILL after ``grace`` seconds). ``url`` peers are
    only checked for health."""

    def __init__(self, name: str, command: list[str] | None, log_path: Path | None, base_url: str | None = None,
                 body: dict | None = None):
        """``base_url`` None: the server names its URL in its output (``compress serve --port 0``)."""
        self.name, self.command, self.log_path = name, command, log_path
        self.base_url = base_url
        self.body = dict(body or {})   # extra fields of every request
        self.process: subprocess.Popen | None = None

    @classmethod
    def from_settings(cls, name: str, settings: PeerSettings, log_dir: Path) -> "RunningPeer":
        if name not in PEERS:
            raise PeerError(f"peer {name!r}: unknown; choose among {', '.join(PEERS)} or give --url {name}=URL")
        kind = PEERS[name]
        port = 0 if kind.port_in_log else free_port()
        return cls(name, kind.command(settings, port), log_dir / f"{name}.log",
                   None if kind.port_in_log else f"http://127.0.0.1:{port}", kind.body)

    def start(self, ready_timeout: float = 600.0) -> "RunningPeer":
        if self.command is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "w") as log:
                log.write("$ " + " ".join(self.command) + "\n")
                log.flush()
                self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.base_url is None and self.log_path is not None:
                from compress.serve.server import url_in_log

                self.base_url = url_in_log(self.log_path.read_text(errors="replace"))
            status = None
            if self.base_url is not None:
                status, _ = http_json(self.base_url.rstrip("/") + "/health", timeout=5.0)
            if status == 200:
                return self
            if self.process is not None and self.process.poll() is not None:
                raise PeerError(f"peer {self.name}: the server exited with {self.process.returncode} before it was "
                                f"ready (log {self.log_path}):\n{_tail(self.log_path)}")
            if time.monotonic() > deadline:
                self.stop()
                where = f" (log {self.log_path}):\n{_tail(self.log_path)}" if self.log_path else ""
                what = f"{self.base_url}/health not 200" if self.base_url else "no 'compress serve: ... on URL' line"
                raise PeerError(f"peer {self.name}: {what} after {ready_timeout:g} s{where}")
            time.sleep(0.25)

    def stop(self, grace: float = 30.0) -> None:
        p, self.process = self.process, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)   # its own session: the server and any child it made
            p.wait()

    def __enter__(self) -> "RunningPeer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
