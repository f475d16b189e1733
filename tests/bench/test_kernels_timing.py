"""compress bench kernels' timing loop: the eviction, then the case's code-warming call on
other weights, then the timed call; and the sweep's warmers share the timed cases' code."""
from __future__ import annotations

import pytest

from compress import ops
from compress.bench import kernels
from compress.bench.kernels import Case, time_cases


def test_each_timed_call_follows_an_eviction_and_its_own_warmer():
    events = []
    cases = [Case("w4a16", "a", lambda: events.append("a"), 1), Case("w8a8", "b", lambda: events.append("b"), 1)]
    warmers = {"w4a16|a": lambda: events.append("warm a")}  # "b" has none: evicted, then timed cold
    med = time_cases(cases, reps=3, budget_s=60.0, evict=lambda: events.append("evict"), warmers=warmers)
    assert set(med) == {"w4a16|a", "w8a8|b"}
    assert events[:2] == ["a", "b"]  # the untimed first touch
    assert events[2:] == ["evict", "warm a", "a", "evict", "b"] * 3


@pytest.mark.skipif(not ops.native_available("cpu"), reason="compress._C not built")
def test_sweep_warms_each_case_with_the_same_case_on_fewer_rows(monkeypatch):
    built = []
    real = kernels.build_cases

    def spy(m, n, k, impls):
        built.append((m, n, k))
        return real(m, n, k, impls)

    monkeypatch.setattr(kernels, "build_cases", spy)
    monkeypatch.setattr(kernels, "WARM_CODE_ROWS", 16)
    for warm_code, expect in ((True, [(1, 64, 256), (1, 16, 256)]), (False, [(1, 64, 256)])):
        built.clear()
        lines = []
        kernels.run([(64, 256)], [1], {"compress"}, reps=3, budget_s=1.0, bandwidth_bytes=8 << 20,
                    log=lines.append, warm_code=warm_code)
        assert built == expect
        assert ("weights cold, code warm" in lines[0]) == warm_code
