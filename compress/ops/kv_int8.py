"""The int8 K / V cache row (``kv_cache_dtype`` int8), as pure tensor functions.

A row is one position's ``head_dim`` values as int8 followed by the row's float32 scale
in the next 4 bytes, so an int8 pool is ``[num_blocks, n_kv_heads, block_size, head_dim
+ 4]`` and a row's scale travels with its values (csrc/cpu/kv_int8.h is the C++ side;
the bits agree, tests compare them):

    scale = max |x| / 127, q = round_half_even(x / scale) in -127..127 (0 where scale is 0)
    x ~ float(q) * scale

Each position is quantized alone, so what a slot holds does not depend on the batch or
the chunk it was written in (prefix-cache hits read what a miss writes).
"""
from __future__ import annotations

import torch

SCALE_BYTES = 4


def row_elems(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one pool row of ``dtype`` for ``head_dim``."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` (any float dtype) -> int8 rows ``[..., D + 4]``."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(xf / scale), torch.zeros_like(xf)).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales ``[...]`` of int8 rows ``[..., D + 4]``."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32).squeeze(-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows ``[..., D + 4]`` -> ``[..., D]`` as ``float(q) * scale`` (float32), in ``dtype``."""
    values = rows[..., :-SCALE_BYTES].to(torch.float32) * row_scales(rows).unsqueeze(-1)
    return values.to(dtype)


def to_pool(x: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """``x [..., D]`` as a pool of ``pool_dtype`` holds it (int8: quantized rows)."""
    return quantize_rows(x) if pool_dtype == torch.int8 else x.to(pool_dtype)


def from_pool(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows (any K / V dtype) as ``[..., D]`` values in ``dtype``."""
    return dequantize_rows(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)
