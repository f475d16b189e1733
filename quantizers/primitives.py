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


PER_CHANNEL = "channel"   # the recipe's spelling of one scale per output row (also -1)


def is_per_channel(group_size: int | str) -> bool:
    """``group_size: channel`` or ``-1`` (the compressed-tensors / AutoAWQ convention)."""
    return group_size == PER_CHANNEL or (isinstance(group_size, int) and group_size == -1)


def group_size_problem(group_size: int | str) -> str | None:
    """Why a recipe's ``group_size`` value is invalid, or None when it is valid."""
    if is_per_channel(group_size):
        return None
    if isinstance(group_size, str):
        return f"must be a positive multiple of 8, {PER_CHANNEL!r} or -1 (per channel), got {group_size!r}"
    if group_size <= 0 or group_size % 8:
        return f"must be a positive multiple of 8, {PER_CHANNEL!r} or -1 (per channel), got {group_size}"
    return None


def resolve_group_size(group_size: int | str, in_features: int) -> int:
    """The group size in elements for a layer: ``in_features`` when per channel."""
    return in_features if is_per_channel(group_size) else int(group_size)


def indivisible_message(name: str, in_features: int, group_size: int, others: int = 0) -> str:
    also = f" (nor are {others} more layers')" if others > 1 else " (nor is 1 more layer's)" if others else ""
    return (f"layer {name!r}: in_features {in_features} is not divisible by group_size {group_size}{also}; "
            f"use group_size: {PER_CHANNEL} (one scale per output row), a group size that divides it, "
            f"or add the layer to ignore")


def check_group_size(in_features: int, group_size: int | str, name: str) -> None:
    problem = group_size_problem(group_size)
    if problem is not None:
        raise ValueError(f"group_size {problem}")
    if not is_per_channel(group_size) and in_features % group_size:
        raise ValueError(indivisible_message(name, in_features, group_size))


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
    return int4_params_from_range(g.amax(dim=-1) * clip_ratio, g.amin(dim=-1) * clip_ratio, symmetric)


def int4_params_from_range(wmax: torch.Tensor, wmin: torch.Tensor,
                           symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`int4_group_params` from each group's (already clipped) max and min: lets a
    search compute the range once and try many clip ratios or scalings on it."""
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
    """Groupwise int4: returns (qweight int32 [N, ceil(K/8)], scales [N, K/g], zeros uint8 [N, K/g]).
    Per channel is ``group_size = K`` (any K, e.g. 172; see :func:`pack_int4_padded`)."""
    scales, zeros = int4_group_params(weight, group_size, symmetric, clip_ratio)
    scales = scales.to(scale_dtype)
    u = _int4_codes(weight, scales, zeros, group_size).to(torch.uint8).reshape(weight.shape)
    return pack_int4_padded(u), scales, zeros


def pack_int4_padded(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, K]`` -> int32 ``[N, ceil(K/8)]`` for any K. When K % 8 != 0 the
    last word's unused nibbles are 0, as compressed-tensors' ``pack_to_int32`` writes
    them (it offsets to unsigned, then pads with zeros); readers slice to ``weight_shape``."""
    pad = (-codes.shape[1]) % 8
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    return pack_int4(codes)


def fake_quantize_int4(weight: torch.Tensor, group_size: int = 128, symmetric: bool = False,
                       clip_ratio: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Quantize then dequantize (float32), for error measurement and searches."""
    scales, zeros = int4_group_params(weight, group_size, symmetric, clip_ratio)
    u = _int4_codes(weight, scales, zeros, group_size)
    return ((u - zeros.to(torch.float32).unsqueeze(-1)) * scales.unsqueeze(-1)).reshape(weight.shape)



def fake_quantize_int4_scaled(weight: torch.Tensor, s: torch.Tensor | None, group_size: int = 128,
                              symmetric: bool = False, rows: int = 256) -> torch.Tensor:
    """``fake_quantize_int4(weight * s) / s`` (``s`` over the input channels, or None for 1),
    bit for bit, in one float32 output buffer worked on in place ``rows`` rows at a time
    (cache-sized): the AWQ scale search calls this for every grid point and weight.
    ``clamp(round(x) + z, 0, 15) - z`` is computed as ``clamp(round(x), -z, 15 - z)``: equal on
    the small integers involved."""
    n, k = weight.shape
    groups = k // group_size
    out = torch.empty(n, k, dtype=torch.float32)
    w3 = weight.to(torch.float32).reshape(n, groups, group_size)
    o3 = out.view(n, groups, group_size)
    s_g = None if s is None else s.to(torch.float32).reshape(groups, group_size)
    for r0 in range(0, n, rows):
        o = o3[r0:r0 + rows]
        if s_g is None:
            o.copy_(w3[r0:r0 + rows])
        else:
            torch.mul(w3[r0:r0 + rows], s_g, out=o)
        wmin, wmax = torch.aminmax(o, dim=-1)
        scales, zeros = int4_params_from_range(wmax, wmin, symmetric)
        z = zeros.to(torch.float32).unsqueeze(-1)
        scale = scales.unsqueeze(-1)
        o.div_(scale).round_().clamp_(min=-z, max=INT4_LEVELS - z).mul_(scale)
        if s_g is not None:
            o.div_(s_g)
    return out
