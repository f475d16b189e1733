"""Random quantized weights for the op tests, each from its own seeded generator."""
from __future__ import annotations

import torch

from compress.ops import reference


def make_int4(n: int, k: int, group: int, scale_dtype=torch.float16, seed: int = 0):
    """Packed int4 [N, K/8], scales [N, K/group] and uint8 zero points of a random layer."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    qweight = reference.pack_int4(u)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(scale_dtype)
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    return qweight, scales, zeros


def make_int8(n: int, k: int, seed: int = 0):
    """Symmetric int8 weights [N, K] in [-127, 127] and their per-channel scales."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return q, torch.rand(n, generator=g) * 0.01 + 1e-3
