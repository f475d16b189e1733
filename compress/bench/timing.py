"""The median wall time of a call, for the benchmarks and labs that time one function."""
from __future__ import annotations

import statistics
import time


def median_seconds(fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
