"""DRAM read bandwidth of this machine, measured the way the kernels read weights:
a vectorised, multi-threaded streaming read (``compress::stream_read_sum``) over a
buffer far larger than the caches, in 2 MiB pages where the platform allows (as the
runtime keeps its weights; on this kind of VM 4 KiB pages read 2-24% slower depending
on the sitting). The figure is the physical limit for M = 1."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from compress import ops  # noqa: F401  (defines torch.ops.compress)
from compress.runtime.hugepages import huge_page_zeros

GIB = 1 << 30
CPU_CACHE_DIR = "/sys/devices/system/cpu/cpu0/cache"


def last_level_cache_bytes(cache_dir: str = CPU_CACHE_DIR) -> int | None:
    """Size of the largest cache level the OS reports for CPU 0 (sysfs ``index*/size``,
    e.g. "32768K"); None where sysfs does not say."""
    best = None
    for index in sorted(Path(cache_dir).glob("index*")):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text) if text.isdigit() else None
        if size is not None and (best is None or level > best[0] or (level == best[0] and size > best[1])):
            best = (level, size)
    return best[1] if best else None


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def read_buffer(nbytes: int) -> tuple[torch.Tensor, bool]:
    """An int64 buffer of ``nbytes`` (rounded up to 8) for ``stream_read_sum``, every page
    committed, in 2 MiB pages where the platform allows; and whether it is."""
    n = -(-nbytes // 8)
    buf = huge_page_zeros((n,), torch.int64)
    huge_pages = buf is not None
    return (torch.empty(n, dtype=torch.int64) if buf is None else buf).fill_(1), huge_pages


def read_bandwidth(nbytes: int = GIB, reps: int = 7) -> dict:
    """Median and best GB/s (1e9 bytes/s) of reading ``nbytes`` with the intra-op pool."""
    nbytes = nbytes // 8 * 8
    buf, huge_pages = read_buffer(nbytes)
    op = torch.ops.compress.stream_read_sum
    op(buf)  # warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        op(buf)
        times.append(time.perf_counter() - t0)
    del buf
    return {"bytes": nbytes, "threads": torch.get_num_threads(), "huge_pages": huge_pages,
            "median_gbps": nbytes / _median(times) / 1e9, "best_gbps": nbytes / min(times) / 1e9}
