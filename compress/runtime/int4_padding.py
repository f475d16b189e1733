"""Load-time padding of per-channel int4 weights to a K the int4 kernels take.

A per-channel layer (one scale and zero point per output row: group size = K) may have
any K, e.g. an MLP with intermediate size 172. The kernels want K a multiple of 8
(8 nibbles per int32 word); the CPU tiles and the CUDA kernel run a group of K
fastest, or at all, when it is a multiple of 64 (the CPU's 64-k chunk, the CUDA tile's
K). So such a layer is padded once at load time to ``Kp = ceil(K / 64) * 64``: the codes
of columns K..Kp are set to the row's zero point, so those weights dequantize to exactly
0 (``(u - z) * s`` with ``u = z``), and the activations get Kp - K zero columns per call
(:func:`pad_activations`). Nothing on disk changes; the group size becomes Kp, still one
group per row with the same scale and zero point.

A padded layer reads a wider input than its neighbours write, so the fused decode step
(``compress::decode_layer``, which passes activations unpadded) cannot take it: its
``decode_spec`` is None and the model decodes module by module.
"""
from __future__ import annotations

import torch

PAD_K_MULTIPLE = 64


def padded_in_features(in_features: int, group_size: int, groups: int) -> int:
    """The K the kernels will see: padded to a multiple of 64 when the layer is one group
    per row (per channel) and K is not already one; else unchanged."""
    if groups != 1 or group_size < in_features or in_features % PAD_K_MULTIPLE == 0:
        return in_features
    return -(-in_features // PAD_K_MULTIPLE) * PAD_K_MULTIPLE


def pad_int4_in_features(qweight: torch.Tensor, zeros: torch.Tensor, group_size: int,
                         in_features: int) -> tuple[torch.Tensor, int]:
    """``(qweight [N, Kp/8], group size Kp)`` for a per-channel layer whose K needs
    padding (see the module doc), else the inputs unchanged. Idempotent: a qweight that
    already holds Kp columns (a fused q/k/v of padded layers) is returned as it is.

    Works on the packed words (the new tensor is the only allocation of its size): the
    padding words are the row's zero point in all 8 nibbles, and a partly used last word
    keeps its K % 8 low nibbles and takes the zero point in the others."""
    kp = padded_in_features(in_features, group_size, zeros.shape[1])
    if kp == in_features:
        return qweight, group_size
    if qweight.shape[1] * 8 == kp:
        return qweight, kp
    n, used = qweight.shape[0], -(-in_features // 8)
    fill = _as_int32(zeros.reshape(n, 1).to(torch.int64) * 0x11111111)  # [N, 1]
    out = fill.expand(n, kp // 8).contiguous()
    out[:, :used] = qweight[:, :used]
    if in_features % 8:
        low = (1 << 4 * (in_features % 8)) - 1  # the nibbles below K in the last word
        last = (qweight[:, used - 1].to(torch.int64) & low) | (fill[:, 0].to(torch.int64) & ~low & 0xFFFFFFFF)
        out[:, used - 1] = _as_int32(last)
    return out, kp


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in 0 .. 2**32 - 1 -> the int32 with those 32 bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pad_activations(x2d: torch.Tensor, k_padded: int) -> torch.Tensor:
    """``x [M, K]`` with zero columns up to ``k_padded`` (the same tensor when no padding)."""
    if x2d.shape[1] == k_padded:
        return x2d
    return torch.nn.functional.pad(x2d, (0, k_padded - x2d.shape[1]))
