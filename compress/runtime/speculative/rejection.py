"""Modified rejection sampling (Leviathan et al. 2023; Chen et al. 2023): which of a
draft's proposed tokens the target keeps, and the token that follows them.

For one sequence, the draft proposed ``d_1 .. d_k``, each drawn from its distribution
``q_i`` (``None``: the proposal was deterministic, ``q_i`` is one-hot at ``d_i``, as for
prompt lookup or a greedy draft), and the target's one verify pass gave ``p_1 .. p_{k+1}``
(``p_i`` the distribution of the token at draft position ``i``; ``p_{k+1}`` the one after
the last draft token). Token ``d_i`` is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``;
at the first rejection the next token is drawn from ``max(0, p_i - q_i)`` renormalised and
the run ends; when all ``k`` are kept a bonus token is drawn from ``p_{k+1}``. Every token
out of this then follows the target's distribution exactly, whatever the draft.

A greedy row (temperature 0) keeps ``d_i`` while it equals ``argmax p_i`` and then takes
the target's argmax: the tokens greedy decoding of the target alone gives.

Everything here is a pure function of tensors and a generator: the engine
(``speculative/decoder.py``) gathers the distributions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compress.runtime.sampling import filter_logits


@dataclass
class RowVerdict:
    """``tokens``: the accepted draft tokens then one more (the recovered or bonus token);
    ``num_accepted``: how many draft tokens were kept (``len(tokens) - 1``)."""
    tokens: list[int]
    num_accepted: int


def target_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """fp32 ``logits [T, V]`` -> the sampling distribution ``[T, V]`` a request with these
    parameters draws from (temperature, then top-k / top-p, then softmax: what
    ``sampling.sample`` draws from). ``temperature`` must be > 0."""
    scaled = logits.float() / temperature
    if top_k > 0 or top_p < 1.0:
        t = scaled.shape[0]
        scaled = filter_logits(scaled, torch.full((t,), max(top_k, 0), dtype=torch.long, device=logits.device),
                               torch.full((t,), float(top_p), device=logits.device))
    return scaled.softmax(dim=-1)


def _uniform(generator: torch.Generator | None, n: int, device) -> torch.Tensor:
    return torch.rand(n, generator=generator, device=device) if n else torch.empty(0, device=device)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs [V]`` (need not be normalised)."""
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_greedy(draft: list[int], target_logits: torch.Tensor) -> RowVerdict:
    """Greedy acceptance: keep draft tokens while they equal the target's argmax, then
    take the target's argmax (``target_logits [k+1, V]``)."""
    best = torch.ops.compress.argmax_rows(target_logits.float().contiguous()).tolist()
    m = 0
    while m < len(draft) and draft[m] == best[m]:
        m += 1
    return RowVerdict(list(draft[:m]) + [int(best[m])], m)


def verify_sampled(draft: list[int], draft_probs: torch.Tensor | None, probs: torch.Tensor,
                   generator: torch.Generator | None = None) -> RowVerdict:
    """Modified rejection sampling for one sequence: ``draft`` (k tokens), ``draft_probs``
    ``[k, V]`` (the distributions they were drawn from; ``None``: deterministic
    proposals), ``probs [k+1, V]`` the target's sampling distributions. Draws ``k``
    uniforms (one per draft token, all of them, so a seeded request's stream does not
    depend on where it was rejected) and one token."""
    k = len(draft)
    if probs.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} target distributions for {k} draft tokens, got {probs.shape[0]}")
    if draft_probs is not None and draft_probs.shape[0] != k:
        raise ValueError(f"need {k} draft distributions for {k} draft tokens, got {draft_probs.shape[0]}")
    u = _uniform(generator, k, probs.device)
    if k:
        idx = torch.as_tensor(draft, device=probs.device).view(-1, 1)
        p_d = probs[:k].gather(1, idx).view(-1)
        q_d = draft_probs.gather(1, idx).view(-1) if draft_probs is not None else torch.ones_like(p_d)
        # keep d_i with probability min(1, p/q): u < p/q, written without dividing by q
        keep = (u * q_d < p_d).tolist()
    else:
        keep = []
    m = 0
    while m < k and keep[m]:
        m += 1
    if m == k:
        return RowVerdict(list(draft) + [_draw(probs[k], generator)], k)
    if draft_probs is not None:
        residual = (probs[m] - draft_probs[m]).clamp_(min=0.0)
    else:
        residual = probs[m].clone()
        residual[draft[m]] = 0.0
    if not float(residual.sum()) > 0.0:
        # p <= q everywhere yet d_m was rejected: only through rounding; p itself is right
        residual = probs[m]
    return RowVerdict(list(draft[:m]) + [_draw(residual, generator)], m)


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) (per row of ``[..., V]``): the chance that one draft
    token drawn from q is kept."""
    return torch.minimum(p, q).sum(-1)
