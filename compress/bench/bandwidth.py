"""DRAM read bandwidth of this machine, measured the way the kernels read weights:
a vectorised, multi-threaded streaming read (``compress::stream_read_sum``) over a
buffer far larger than the caches. The figure is the physical limit for M = 1."""
from __future__ import annotations

import time

import torch

from compress import ops  # noqa: F401  (defines torch.ops.compress)

GIB = 1 << 30


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def read_bandwidth(nbytes: int = GIB, reps: int = 7) -> dict:
    """Median and best GB/s (1e9 bytes/s) of reading ``nbytes`` with the intra-op pool."""
    buf = torch.ones(nbytes // 8, dtype=torch.int64)
    op = torch.ops.compress.stream_read_sum
    op(buf)  # fault pages in, warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        op(buf)
        times.append(time.perf_counter() - t0)
    del buf
    return {"bytes": nbytes, "threads": torch.get_num_threads(),
            "median_gbps": nbytes / _median(times) / 1e9, "best_gbps": nbytes / min(times) / 1e9}
