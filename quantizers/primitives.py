"""Pure tensor functions: quantize, dequantize and pack weights.

No modules, no hooks: tensors in, tensors out, in the canonical op layout of
``compress/ops/reference.py`` so the results can be handed straight to the runtime
layers and the exporter.
"""
from __future__ import annotations

import torch

from compress.ops.reference import pack_int4

INT4_LEVELS = 15  # unsigned 0..15


def check_finite(weight: torch.Tensor, name: str) -> None:
    if not torch.isfinite(weight).all():
        bad = (~torch.isfinite(weight)).sum().item()
        raise ValueError(f"weight of {name!r} has {bad} NaN/Inf values; refusing to quantize")


def check_group_size(in_features: int, group_size: int, name: str) -> None:
    if group_size <= 0 or group_size % 8:
        raise ValueError(f"group_size must be a positive multiple of 8, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"layer {name!r}: in_features {in_features} is not divisible by "
                         f"group_size {group_size}; choose a group size that divides it or ignore the layer")


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``w ≈ q * scale[:, None]``."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1).clamp_min(1e-10) / 127.0
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8_per_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * scale.to(torch.float32).unsqueeze(1)


def int4_group_params(weight: torch.Tensor, group_size: int, symmetric: bool = False,
                      clip_ratio: torch.Tensor | float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and unsigned zero points ``[N, K/g]`` for groupwise int4.

    ``clip_ratio`` (scalar or ``[N, K/g]``) shrinks the range before rounding (AWQ clip search).
    """
    n, k = weight.shape
    g = weight.to(torch.float32).reshape(n, k // group_size, group_size)
    wmax = g.amax(dim=-1) * clip_ratio
    wmin = g.amin(dim=-1) * clip_ratio
    if symmetric:
        amax = torch.maximum(wmax.abs(), wmin.abs()).clamp_min(1e-10)
        scales = amax / 7.0
        zeros = torch.full_like(scales, 8.0)
    else:
        wmax = wmax.clamp_min(0.0)  # the range always contains 0 so zero is exact
        wmin = wmin.clamp_max(0.0)
        scales = ((wmax - wmin) / INT4_LEVELS).clamp_min(1e-10)
        zeros = torch.round(-wmin / scales).clamp_(0, INT4_LEVELS)
    return scales, zeros.to(torch.uint8)


def _int4_codes(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Unsigned int4 codes ``[N, K/g, g]`` (float) for the given group scales and zeros."""
    n, k = weight.shape
    g = weight.to(torch.float32).reshape(n, k // group_size, group_size)
    u = torch.round(g / scales.to(torch.float32).unsqueeze(-1)) + zeros.to(torch.float32).unsqueeze(-1)
    return u.clamp_(0, INT4_LEVELS)


def quantize_int4_groupwise(weight: torch.Tensor, group_size: int = 128, symmetric: bool = False,
                            clip_ratio: torch.Tensor | float = 1.0,
                            scale_dtype: torch.dtype = torch.float32):
    """Groupwise int4: returns (qweight int32 [N, K/8], scales [N, K/g], zeros uint8 [N, K/g])."""
    scales, zeros = int4_group_params(weight, group_size, symmetric, clip_ratio)
    scales = scales.to(scale_dtype)
    u = _int4_codes(weight, scales, zeros, group_size).to(torch.uint8).reshape(weight.shape)
    return pack_int4(u), scales, zeros


def fake_quantize_int4(weight: torch.Tensor, group_size: int = 128, symmetric: bool = False,
                       clip_ratio: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Quantize then dequantize (float32), for error measurement and searches."""
    scales, zeros = int4_group_params(weight, group_size, symmetric, clip_ratio)
    u = _int4_codes(weight, scales, zeros, group_size)
    return ((u - zeros.to(torch.float32).unsqueeze(-1)) * scales.unsqueeze(-1)).reshape(weight.shape)

