"""How close an approximation is to its reference, as the tests, the kernel labs and the
benchmarks measure it. A leaf module (torch only)."""
from __future__ import annotations

import torch


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|ref|^2 / |ref - approx|^2)."""
    ref = reference.to(torch.float64)
    noise = (ref - approx.to(torch.float64)).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / noise.clamp_min(1e-30)))
