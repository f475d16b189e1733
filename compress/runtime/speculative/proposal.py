"""What a drafter hands the engine for one step."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    """``tokens[r]``: the draft tokens proposed for row r (possibly none);
    ``probs[r]``: ``[len(tokens[r]), V]`` the distributions they were drawn from, or
    ``None`` for a deterministic proposal (greedy draft, prompt lookup); ``probs`` itself
    is ``None`` when every row's proposal is deterministic."""
    tokens: list[list[int]]
    probs: list[torch.Tensor | None] | None = None

    def probs_of(self, r: int) -> torch.Tensor | None:
        return None if self.probs is None else self.probs[r]
