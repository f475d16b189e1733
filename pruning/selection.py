"""Which channels, heads and blocks a prune keeps: top-k of importance scores, or seeded
random indices of the same shapes (the control). Pure functions on small tensors; every
result is ascending int64 indices, what ``pruning/channel_slices.py`` takes.
"""
from __future__ import annotations

import torch


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` highest-scoring positions of each row of ``scores`` (``[..., n]``), in
    ascending order. Ties go to the lower index (a stable sort), so the choice is
    reproducible."""
    if not 1 <= k <= scores.shape[-1]:
        raise ValueError(f"cannot keep {k} of {scores.shape[-1]}")
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices
    return order[..., :k].sort(dim=-1).values.to(torch.int64)


def random_k(n: int, k: int, generator: torch.Generator, rows: int | None = None) -> torch.Tensor:
    """``k`` of ``n`` positions drawn without replacement, ascending: ``[k]``, or
    ``[rows, k]`` with an independent draw per row."""
    if not 1 <= k <= n:
        raise ValueError(f"cannot keep {k} of {n}")
    if rows is None:
        return torch.randperm(n, generator=generator)[:k].sort().values
    return torch.stack([torch.randperm(n, generator=generator)[:k].sort().values for _ in range(rows)])


def choose_heads(scores: torch.Tensor | None, blocks: int, heads: int, kv_heads: int, keep_heads: int,
                 keep_kv: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Query heads kept per block, ``[blocks, keep_heads]``, laid out as GQA needs:
    ``keep_kv`` whole kv groups (the ``heads // kv_heads`` query heads sharing a kv head),
    and in each kept group the same ``keep_heads // keep_kv`` query heads.

    ``scores``: ``[blocks, heads]`` importance (a group's importance is the sum of its
    heads'); None draws groups and heads at random from ``generator``."""
    per_kv = heads // kv_heads
    if heads % kv_heads or keep_heads % keep_kv or keep_kv > kv_heads or keep_heads // keep_kv > per_kv:
        raise ValueError(f"cannot keep {keep_heads} query heads in {keep_kv} kv groups of a model with "
                         f"{heads} query heads in {kv_heads} kv groups")
    per_group = keep_heads // keep_kv
    rows = []
    for block in range(blocks):
        if scores is None:
            groups = random_k(kv_heads, keep_kv, generator)
            local = random_k(per_kv, per_group, generator, rows=keep_kv)
        else:
            by_group = scores[block].reshape(kv_heads, per_kv)
            groups = top_k(by_group.sum(dim=1), keep_kv)
            local = top_k(by_group[groups], per_group)
        rows.append((groups.unsqueeze(1) * per_kv + local).flatten().sort().values)
    return torch.stack(rows)
