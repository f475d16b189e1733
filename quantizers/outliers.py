"""Pure tensor functions of LLM.int8() (Dettmers et al. 2022): outlier detection and
vector-wise int8 quantization with a float side-path for the outlier input columns.

No modules, no hooks. ``quantizers/llm_int8.py`` gathers the activation statistics
and swaps the weights; this file only turns tensors into tensors.

Static vs dynamic outlier columns
---------------------------------
bitsandbytes finds the outlier columns of every batch at run time (a column-wise
max over the activations, then a variable-size gather). We calibrate a *static* set per
linear: the fused op then gathers a fixed list of columns against a contiguous,
pre-extracted float weight slice ``[N, C]`` -- no reduction over the activations before
the GEMM, fixed shapes (torch.compile / CUDA graphs friendly), and the float slice is
stored once instead of being dequantized on every call. The price is a column that
spikes at run time outside the calibrated set: it then sets that token's int8 scale and
crushes the token's other features. ``compress.ops.reference.w8a8_outlier_gemm_guarded``
is the policy the runtime's layer applies: a per-batch guard that moves any *extra*
column reaching the threshold to the float path, using the (dequantized) int8 weight columns, as
bitsandbytes does. When nothing spikes it computes exactly what the static op computes.
"""
from __future__ import annotations

import torch

from compress.io.schemes import QuantizedWeight
from quantizers import primitives


def column_absmax(x: torch.Tensor) -> torch.Tensor:
    """Per input feature, the largest magnitude over all tokens: ``[..., K] -> [K]`` fp32."""
    return x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).to(torch.float32)


def find_outlier_columns(absmax: torch.Tensor, threshold: float) -> torch.Tensor:
    """Input dims whose activation magnitude reaches ``threshold``: sorted int64 ``[C]``."""
    if threshold <= 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    return torch.nonzero(absmax >= threshold).flatten().to(torch.int64)


def quantize_llm_int8(weight: torch.Tensor, outlier_idx: torch.Tensor, threshold: float,
                      outlier_dtype: torch.dtype = torch.float32) -> QuantizedWeight:
    """Vector-wise int8 weight (per output row, symmetric) plus the float outlier columns.

    The row scales cover the whole row (outlier columns included), so ``qweight`` and
    ``weight_scale`` are exactly the bitsandbytes ``CB``/``SCB`` pair and a loader that
    decomposes dynamically gets a faithful int8 matrix too. In our op the int8 entries at
    ``outlier_idx`` are ignored; ``outlier_weight`` holds those columns unquantized.
    """
    q, scale = primitives.quantize_int8_per_channel(weight)
    idx = outlier_idx.to(torch.int64).flatten()
    return QuantizedWeight("llm_int8", {
        "qweight": q,
        "weight_scale": scale,
        "outlier_idx": idx.clone(),
        "outlier_weight": weight.detach()[:, idx].to(outlier_dtype).contiguous(),
    }, {"threshold": float(threshold)})
