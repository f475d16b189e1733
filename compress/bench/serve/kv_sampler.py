"""Samples a compress server's KV reserve while a load runs: a thread reads ``/metrics``
every ``interval`` seconds and keeps, per sample, the KV slots the running sequences hold
past their computed positions (``compress_kv_slots_reserved_unused``), the running
sequences and the blocks in use. A server without those gauges (llama-server) gives no
samples; the row then has no KV figure."""
from __future__ import annotations

import threading

from compress.bench.serve.client import http_json
from compress.serve.soak import parse_metrics

RESERVED = "compress_kv_slots_reserved_unused"


class KVSampler:
    def __init__(self, base_url: str, headers: dict[str, str] | None = None, interval: float = 0.1):
        self.url = base_url.rstrip("/") + "/metrics"
        self.headers = headers or {}
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-sampler", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            status, text = http_json(self.url, headers=self.headers, timeout=5.0)
            if status == 200 and isinstance(text, str):
                m = parse_metrics(text)
                if RESERVED in m:
                    self.samples.append({"reserved_unused": m[RESERVED],
                                         "running": m.get("compress_requests_running", 0.0),
                                         "blocks_used": m.get("compress_kv_blocks_used", 0.0),
                                         "block_size": m.get("compress_kv_block_size", 0.0)})
            self._stop.wait(self.interval)

    def __enter__(self) -> "KVSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def summarize(samples: list[dict[str, float]]) -> dict | None:
    """Mean and largest reserve a running sequence, over the samples with sequences
    running; None without samples."""
    busy = [s for s in samples if s["running"] > 0]
    if not busy:
        return None
    per_seq = [s["reserved_unused"] / s["running"] for s in busy]
    return {"samples": len(busy), "block_size": busy[-1]["block_size"],
            "reserved_unused_per_seq_mean": sum(per_seq) / len(per_seq),
            "reserved_unused_per_seq_max": max(per_seq),
            "blocks_used_max": max(s["blocks_used"] for s in busy)}


def merge(summaries: list[dict | None]) -> dict | None:
    """One figure over rounds: samples pooled (means weighted by them), maxima of maxima."""
    got = [s for s in summaries if s]
    if not got:
        return None
    n = sum(s["samples"] for s in got)
    return {"samples": n, "block_size": got[-1]["block_size"],
            "reserved_unused_per_seq_mean": sum(s["reserved_unused_per_seq_mean"] * s["samples"] for s in got) / n,
            "reserved_unused_per_seq_max": max(s["reserved_unused_per_seq_max"] for s in got),
            "blocks_used_max": max(s["blocks_used_max"] for s in got)}
