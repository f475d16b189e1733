"""The outlier column indices of an LLM.int8() layer, checked once at load time.

An index ``j`` names input column ``j``; ``-K <= j < 0`` names column ``K + j``, as the
reference's ``x[:, idx]`` reads it. Anything else is an error here, at load: the
reference would raise at the first call and the CUDA kernel would leave the column out
(it never reads or writes outside the row for a bad index, but the result would be
another layer's)."""
from __future__ import annotations

import torch

from compress.errors import UserError


class OutlierIndexError(UserError):
    """An LLM.int8() layer's outlier_idx is not a list of its input columns."""


def checked_outlier_idx(idx: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """``idx`` as contiguous int64 with every entry in ``[0, in_features)`` (negative
    entries wrapped as the reference reads them); raises OutlierIndexError otherwise."""
    where = f"outlier_idx of an LLM.int8() layer [N={out_features}, K={in_features}]"
    if idx.dim() != 1 or idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise OutlierIndexError(f"{where} must be a 1-D integer tensor [C], got {idx.dtype} {list(idx.shape)}")
    idx = idx.to(torch.long).contiguous()
    if idx.numel() == 0:
        return idx
    bad = idx[(idx < -in_features) | (idx >= in_features)]
    if bad.numel():
        raise OutlierIndexError(f"{where} holds {bad[:4].tolist()}{' ...' if bad.numel() > 4 else ''}, "
                                f"outside [-{in_features}, {in_features})")
    return torch.where(idx < 0, idx + in_features, idx)
