"""Rotary position embeddings: the inverse frequencies a config asks for, and the
cos/sin tables the decoder indexes by position.

Supported ``rope_type``: ``default``, ``linear``, ``llama3``. Anything else is refused.
The config shim (``rope_parameters`` in transformers 5, ``rope_theta`` +
``rope_scaling`` before) lives in ``rope_parameters`` below and nowhere else.
"""
from __future__ import annotations

import math

import torch
from compress.errors import UserError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedRopeError(UserError):
    pass


def rope_parameters(config) -> dict:
    """``{'rope_type', 'rope_theta', ...scaling keys}`` from a HF config of any version."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def inverse_frequencies(config, head_dim: int) -> torch.Tensor:
    """fp32 ``[head_dim // 2]`` inverse frequencies, scaled as the config says."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRopeError(
            f"rope_type {rope_type!r} is not supported by the compress runtime; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedRopeError(f"partial_rotary_factor={partial} is not supported")
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        inv = inv / float(params["factor"])
    elif rope_type == "llama3":
        inv = _llama3_scale(inv, params)
    return inv


def _llama3_scale(inv: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths divided by ``factor``,
    short ones kept, a smooth interpolation in between."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_ctx = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    long_wave = wavelen > old_ctx / low
    short_wave = wavelen < old_ctx / high
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(long_wave, inv / factor, torch.where(short_wave, inv, mid))


def rope_tables(inv_freq: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin ``[max_len, head_dim]`` (the half-dim table repeated twice)."""
    t = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()
