"""Pure tensor functions of AWQ (Lin et al. 2023): activation-aware scale search,
scale folding and weight-clip search for groupwise int4.

The idea: a few input channels carry much larger activations than the rest; scaling
those weight columns up by ``s`` before quantization (and the activations down by
``1/s``, folded into the operator that produces them) shrinks their relative rounding
error. ``s = s_x ** alpha`` with ``alpha`` grid-searched against the output error.

No hooks here: the search takes a ``loss_of(candidate weights)`` callable, so the
caller decides what output is compared (a whole attention / MLP module, or one linear).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Sequence

import torch

from quantizers.primitives import INT4_LEVELS, fake_quantize_int4_scaled, int4_params_from_range


@contextmanager
def elementwise_threads(n: int = 1):
    """Run the searches' long chains of small memory-bound ops on ``n`` threads. Each op is
    an OpenMP region whose threads join at its end; on a machine whose cores other processes
    also use, a join waits for a descheduled thread's time slice. On the 2-core dev machine
    under a load of ~2.6, one 2816x1024 pseudo-quantization took 12 ms on one thread and
    605 ms on two, a clip search 0.28 s and 9.9 s (the matrix products, which stay on all
    threads, lost little: 61-64 vs 73-77 ms)."""
    before = torch.get_num_threads()
    if n >= before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def activation_scale(x: torch.Tensor) -> torch.Tensor:
    """Mean magnitude of each input channel over all tokens: ``[..., K] -> [K]`` fp32."""
    return x.detach().reshape(-1, x.shape[-1]).abs().to(torch.float32).mean(dim=0)


def weight_scale(weights: Sequence[torch.Tensor], group_size: int) -> torch.Tensor:
    """Per input channel mean of ``|w| / max |w| in its group`` over all rows of all weights."""
    rows = []
    for w in weights:
        n, k = w.shape
        g = w.detach().to(torch.float32).abs().reshape(n, k // group_size, group_size)
        rows.append((g / g.amax(dim=-1, keepdim=True).clamp_min(1e-10)).reshape(n, k))
    return torch.cat(rows).mean(dim=0)


def scales_for_alpha(s_x: torch.Tensor, alpha: float, w_mean: torch.Tensor | None = None) -> torch.Tensor:
    """``s = s_x^alpha`` (``/ w_mean^(1-alpha)`` with duo scaling), normalised so that
    ``max(s) * min(s) = 1`` (a common factor does not change int4 rounding)."""
    s = s_x.clamp_min(1e-4).pow(alpha)
    if w_mean is not None:
        s = s / w_mean.clamp_min(1e-4).pow(1 - alpha)
    s = s.clamp_min(1e-4)
    return s / (s.max() * s.min()).sqrt()


def search_scale(s_x: torch.Tensor, weights: Sequence[torch.Tensor],
                 loss_of: Callable[[list[torch.Tensor]], float], group_size: int,
                 symmetric: bool = False, n_grid: int = 20, duo_scaling: bool = False,
                 expand: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """Grid-search ``alpha`` in ``[0, 1)``; returns ``(best s, best alpha, losses)``.

    ``weights`` are the float ``[N_i, K]`` weights reading the scaled input; each candidate
    handed to ``loss_of`` is ``Q(W * s) / s`` (what the layer computes once ``1/s`` is folded
    into the producing operator). ``alpha = 0`` is plain round-to-nearest, so the result is
    never worse than RTN on the calibration objective. ``expand`` maps a scale over the
    producer's channels to the consumers' input channels (GQA: kv heads -> query heads).
    """
    expand = expand or (lambda t: t)
    w_mean = None
    if duo_scaling:
        w_mean = weight_scale(weights, group_size)
        if w_mean.numel() != s_x.numel():   # consumer space -> producer space is the caller's job
            raise ValueError("duo_scaling needs s_x in the consumers' input space")
    best = (float("inf"), None, 0.0)
    losses = []
    for i in range(n_grid):
        alpha = i / n_grid
        s = scales_for_alpha(s_x, alpha, w_mean)
        sk = expand(s)
        with elementwise_threads():
            cand = [fake_quantize_int4_scaled(w, sk, group_size, symmetric) for w in weights]
        loss = float(loss_of(cand))
        losses.append(loss)
        if loss < best[0]:
            best = (loss, s, alpha)
    if best[1] is None:  # every loss NaN
        raise ValueError("AWQ scale search produced no finite loss (NaN activations?)")
    return best[1], best[2], losses


@torch.no_grad()
def fold_scale_into_norm(norm_weight: torch.Tensor, linear_weights: Sequence[torch.Tensor],
                         s: torch.Tensor) -> None:
    """In place: ``norm.weight /= s``, consumers' input columns ``*= s`` (function unchanged)."""
    norm_weight.div_(s.to(norm_weight.dtype))
    for w in linear_weights:
        w.mul_(s.to(w.dtype).unsqueeze(0))


@torch.no_grad()
def fold_scale_into_linear(prev_weight: torch.Tensor, prev_bias: torch.Tensor | None,
                           linear_weights: Sequence[torch.Tensor], s_prev: torch.Tensor,
                           s_in: torch.Tensor) -> None:
    """In place: producer rows (and bias) ``/= s_prev``, consumers' columns ``*= s_in``.

    ``s_in`` is ``s_prev`` mapped onto the consumers' input channels (equal unless the
    producer's outputs are repeated, as v_proj's are for the query heads under GQA).
    """
    prev_weight.div_(s_prev.to(prev_weight.dtype).unsqueeze(1))
    if prev_bias is not None:
        prev_bias.div_(s_prev.to(prev_bias.dtype))
    for w in linear_weights:
        w.mul_(s_in.to(w.dtype).unsqueeze(0))


def kv_head_maps(num_heads: int, num_kv_heads: int, head_dim: int):
    """``(expand, reduce)`` between v_proj's output channels ``[kv*hd]`` and o_proj's input
    channels ``[heads*hd]``: query head ``h`` reads kv head ``h // (heads // kv)``."""
    rep = num_heads // num_kv_heads

    def expand(s: torch.Tensor) -> torch.Tensor:
        return s.reshape(num_kv_heads, 1, head_dim).expand(num_kv_heads, rep, head_dim).reshape(-1)

    def reduce(s: torch.Tensor) -> torch.Tensor:
        return s.reshape(num_kv_heads, rep, head_dim).mean(dim=1).reshape(-1)

    return expand, reduce


def group_gram(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per input group, the tokens' mean outer product: ``[T, K] -> [K/g, g, g]`` fp32.
    ``|x_g d^T|^2`` averaged over the tokens is ``d H_g d^T`` for any ``d`` ``[g]``."""
    t, k = x.shape
    xg = x.to(torch.float32).reshape(t, k // group_size, group_size).transpose(0, 1)   # [G, T, g]
    return torch.bmm(xg.transpose(1, 2), xg).div_(t)


@torch.no_grad()
def search_clip(weight: torch.Tensor, x: torch.Tensor, group_size: int, symmetric: bool = False,
                n_grid: int = 20, max_shrink: float = 0.5, row_chunk: int = 256) -> torch.Tensor:
    """Per (row, group) clip ratio in ``[1 - max_shrink, 1]`` minimising the error of that
    group's contribution to the output, ``|x_g (W_g - Q_r(W_g))^T|^2`` averaged over the tokens
    ``x`` ``[T, K]``. Returns ``[N, K/g]`` for :func:`primitives.quantize_int4_groupwise`."""
    gram = group_gram(x, group_size)
    with elementwise_threads():
        return search_clip_gram(weight, gram, symmetric, n_grid, max_shrink, row_chunk)


@torch.no_grad()
def search_clip_gram(weight: torch.Tensor, gram: torch.Tensor, symmetric: bool = False,
                     n_grid: int = 20, max_shrink: float = 0.5, row_chunk: int = 256) -> torch.Tensor:
    """:func:`search_clip` from the tokens' per-group Gram matrices ``[K/g, g, g]``
    (:func:`group_gram`): each ratio's error is ``d H_g d^T`` with ``d = W_g - Q_r(W_g)``,
    one batched ``[G, rows, g] @ [G, g, g]`` product, whatever the number of tokens."""
    n, k = weight.shape
    groups, group_size = gram.shape[0], gram.shape[1]
    ratios = [1 - max_shrink * i / n_grid for i in range(n_grid)]
    best_ratio = torch.ones(groups, n)
    gram = gram.to(torch.float32)
    for r0 in range(0, n, row_chunk):
        # [G, rows, g]: the batched product's layout, made once per chunk
        wg = weight[r0:r0 + row_chunk].to(torch.float32).reshape(-1, groups, group_size).transpose(0, 1).contiguous()
        wmax, wmin = wg.amax(dim=-1), wg.amin(dim=-1)                     # [G, rows]
        best_err = torch.full_like(wmax, float("inf"))
        best = best_ratio[:, r0:r0 + row_chunk]
        d = torch.empty_like(wg)
        for r in ratios:
            scales, zeros = int4_params_from_range(wmax * r, wmin * r, symmetric)
            scale, z = scales.unsqueeze(-1), zeros.to(torch.float32).unsqueeze(-1)
            # d = Q_r(W) - W (the sign does not change d H d^T)
            torch.div(wg, scale, out=d).round_().clamp_(min=-z, max=INT4_LEVELS - z).mul_(scale).sub_(wg)
            err = (torch.bmm(d, gram) * d).sum(dim=-1)                        # [G, rows]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best.masked_fill_(better, r)
    return best_ratio.t().contiguous()
