"""Checks on tensors that must not cost more than reading them once.

``torch.isfinite(t).all()`` makes a bool tensor and float temporaries the size of ``t``
and runs at ~20 ns per element on this machine's CPUs (1 s for a 45M-element 7B MLP
weight); ``torch.aminmax`` is one pass with no temporary (~1.5 ns per element), and a
NaN propagates into both extremes while an infinity is one of them.
"""
from __future__ import annotations

import torch


def all_finite(t: torch.Tensor) -> bool:
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.reshape(-1))
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def count_nonfinite(t: torch.Tensor, chunk: int = 1 << 22) -> int:
    """How many elements are NaN or infinite (for error messages; in slices, so the
    temporaries stay small)."""
    if not t.is_floating_point():
        return 0
    flat = t.reshape(-1)
    return sum(int((~torch.isfinite(flat[i:i + chunk])).sum()) for i in range(0, flat.numel(), chunk))
