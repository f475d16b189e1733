"""A bounded soak of ``compress serve`` over loopback: many short requests, some of whose
clients are killed mid-stream; the server's RSS and used KV blocks must not grow once the
queue has drained.

    python -m compress.serve.soak [PATH] --requests 1000 --concurrency 8 --kill-every 7

It starts ``compress serve PATH`` as a child process on 127.0.0.1 (a free port), sends
``--requests`` completions from ``--concurrency`` concurrent clients (a mix of plain and
streamed; every ``--kill-every``-th streamed client reads a few events and then drops its
connection with a TCP reset), waits after each quarter until the server reports nothing in
flight, and reads the server's RSS (``/proc/PID/status``) and ``/metrics`` there. It prints
one JSON report: RSS after each quarter, KV blocks used, requests that failed, and the RSS
growth from the first quarter's end to the last (the first quarter warms the allocator
and caches up). The server gets a small KV pool (``--kv-cache-tokens``, default 1024): the
pool is anonymous memory committed as blocks are first written, so with a large one a
later burst that reaches blocks never used before adds RSS (12 new 2 MiB pages, one per
layer for keys and values, on the embedded model) that is the pool filling in, not a leak;
a small pool is all touched in the first quarter. Everything is bounded: request count, a per-request timeout and a
deadline for the whole run. Traffic goes to 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOST = "127.0.0.1"
PROMPTS = ["Return the", "Create a new", "If the", "The default", "This function", "Raise a",
           "Return a list of", "Set the"]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def http_request(port: int, method: str, path: str, body: dict | None = None,
                       timeout: float = 60.0, kill_after_events: int | None = None) -> tuple[int, bytes]:
    """One HTTP/1.1 request on its own connection. ``kill_after_events``: read that many SSE
    events, then reset the connection (SO_LINGER 0) as a killed client would; status 0."""
    data = b"" if body is None else json.dumps(body).encode()
    head = (f"{method} {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), timeout)
    try:
        writer.write(head + data)
        await writer.drain()
        if kill_after_events is not None:
            seen = 0
            while seen < kill_after_events:
                line = await asyncio.wait_for(reader.readline(), timeout)
                if not line:
                    break
                seen += line.startswith(b"data:")
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return 0, b""
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        if not writer.is_closing():
            writer.close()
    status = int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/") else -1
    return status, raw.partition(b"\r\n\r\n")[2]


async def wait_idle(port: int, deadline: float) -> dict[str, float]:
    """Poll ``/metrics`` until nothing is in flight and no sequence runs or waits."""
    while True:
        _, body = await http_request(port, "GET", "/metrics")
        m = parse_metrics(body.decode())
        if (m.get("compress_requests_in_flight", 1) == 0 and m.get("compress_requests_running", 1) == 0
                and m.get("compress_requests_waiting", 1) == 0):
            return m
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not drain: {m}")
        await asyncio.sleep(0.05)


async def run_soak(port: int, pid: int, requests: int, concurrency: int, kill_every: int,
                   max_tokens: int, seed: int, deadline_s: float) -> dict:
    rng = random.Random(seed)
    deadline = time.monotonic() + deadline_s
    counts = {"ok": 0, "killed": 0, "failed": 0}
    failures: list[str] = []
    checkpoints = []
    quarter = max(1, requests // 4)
    sem = asyncio.Semaphore(concurrency)
    streamed = 0

    async def one(i: int) -> None:
        nonlocal streamed
        stream = rng.random() < 0.5
        kill = None
        if stream:
            streamed += 1
            if kill_every and streamed % kill_every == 0:
                kill = rng.randint(1, 3)
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, max_tokens),
                "temperature": rng.choice([0.0, 0.8]), "seed": i, "stream": stream}
        if kill is not None:     # long enough that the kill lands mid-stream
            body.update(max_tokens=max_tokens * 4, ignore_eos=True)
        async with sem:
            try:
                status, payload = await http_request(port, "POST", "/v1/completions", body,
                                                     kill_after_events=kill)
            except Exception as exc:   # noqa: BLE001 - counted and reported
                counts["failed"] += 1
                failures.append(f"request {i}: {type(exc).__name__}: {exc}")
                return
        if kill is not None:
            counts["killed"] += 1
        elif status == 200 and (not stream or b"data: [DONE]" in payload):   # (chunked framing around it)
            counts["ok"] += 1
        else:
            counts["failed"] += 1
            failures.append(f"request {i}: HTTP {status}: {payload[:200]!r}")

    for start in range(0, requests, quarter):
        await asyncio.gather(*(one(i) for i in range(start, min(start + quarter, requests))))
        m = await wait_idle(port, deadline)
        checkpoints.append({"requests_done": min(start + quarter, requests), "rss_mb": rss_bytes(pid) / 2**20,
                            "kv_blocks_used": m.get("compress_kv_blocks_used"),
                            "kv_blocks_total": m.get("compress_kv_blocks_total"),
                            "server_saw_disconnects": m.get("compress_requests_disconnected_total")})
    growth = checkpoints[-1]["rss_mb"] - checkpoints[0]["rss_mb"]
    return {"requests": requests, "concurrency": concurrency, **counts, "failures": failures[:10],
            "checkpoints": checkpoints, "rss_growth_after_first_quarter_mb": growth,
            "kv_blocks_used_at_end": checkpoints[-1]["kv_blocks_used"]}


def start_server(path: str, extra: list[str], log) -> subprocess.Popen:
    """``compress serve`` on a free port of its choosing, its output to ``log`` (a file)."""
    cmd = [sys.executable, "-m", "compress.cli", "serve", path, "--host", HOST, "--port", "0",
           "--log-level", "warning", *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def port_from_log(log, proc: subprocess.Popen, timeout: float) -> int:
    """The port the server named in its output (read in place: the server shares the
    file's offset, so seeking would move where it writes)."""
    from compress.serve.server import url_in_log

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        url = url_in_log(os.pread(log.fileno(), 1 << 20, 0).decode(errors="replace"))
        if url:
            return int(url.rsplit(":", 1)[1])
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it named its port")
        time.sleep(0.1)
    raise TimeoutError("the server did not name its port")


async def wait_healthy(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            status, _ = await http_request(port, "GET", "/health", timeout=2)
            if status == 200:
                return
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError("the server did not become healthy")


def soak(path: str, requests: int = 1000, concurrency: int = 8, kill_every: int = 7, max_tokens: int = 24,
         seed: int = 0, deadline_s: float = 1800.0, server_args: list[str] | None = None,
         kv_cache_tokens: int | None = 1024) -> dict:
    server_args = list(server_args or [])
    if kv_cache_tokens:
        server_args += ["--kv-cache-tokens", str(kv_cache_tokens)]
    with tempfile.TemporaryFile() as log:
        proc = start_server(path, server_args, log)
        try:
            port = port_from_log(log, proc, 120)
            asyncio.run(wait_healthy(port, proc, 120))
            report = asyncio.run(run_soak(port, proc.pid, requests, concurrency, kill_every, max_tokens, seed,
                                          deadline_s))
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-4000:])
            raise
        finally:
            proc.terminate()
            try:
                rc = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        log.seek(0)
        report["server_log_tail"] = log.read().decode(errors="replace")[-2000:]
    report["server_exit_code"] = rc
    return report


def main(argv: list[str] | None = None) -> int:
    from compress.serve.cli import EMBEDDED_MODEL

    p = argparse.ArgumentParser(prog="python -m compress.serve.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default=str(EMBEDDED_MODEL))
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--kill-every", type=int, default=7, help="kill every Nth streamed client mid-stream (0: none)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=1800.0, help="seconds for the whole soak")
    p.add_argument("--kv-cache-tokens", type=int, default=1024,
                   help="the server's KV pool (small: all of it is committed in the first quarter); 0: its default")
    p.add_argument("--json", help="also write the report here")
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: options of compress serve")
    args = p.parse_args(argv)
    extra = [a for a in args.server_args if a != "--"]
    report = soak(args.path, args.requests, args.concurrency, args.kill_every, args.max_tokens, args.seed,
                  args.deadline, extra, args.kv_cache_tokens or None)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        tmp = f"{args.json}.tmp{os.getpid()}"
        Path(tmp).write_text(text)
        os.replace(tmp, args.json)
    return 0 if report["failed"] == 0 and report["kv_blocks_used_at_end"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
