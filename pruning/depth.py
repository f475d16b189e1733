"""Depth importance: how much each decoder block changes what flows through the model.

* Block Importance (Men et al. 2024, "ShortGPT"; the Minitron papers use it for depth):
  ``BI = 1 - cos(x, f(x))`` between a block's input and output, averaged over every
  calibration token. A block whose output equals its input scores 0.
* LM loss: the calibration loss of the model with that one block skipped, minus the
  full model's. :class:`SkippedBlockStreams` computes it for every block in the same
  single pass over the blocks, by carrying one extra activation stream per block
  (the stream that skipped it) -- ``layers + 1`` streams of calibration activations.
"""
from __future__ import annotations

import torch
from torch import nn

from compress.calibration import BlockInputs, run_block


class BlockImportance:
    """Accumulates ``1 - cos`` between a block's input and output over the calibration batches."""

    def __init__(self):
        self.cos_sum, self.tokens = 0.0, 0

    def update(self, inputs: torch.Tensor, outputs: torch.Tensor) -> None:
        cos = nn.functional.cosine_similarity(inputs.float(), outputs.float(), dim=-1)
        self.cos_sum += float(cos.sum(dtype=torch.float64))
        self.tokens += cos.numel()

    def value(self) -> float:
        return 1.0 - self.cos_sum / max(1, self.tokens)


class SkippedBlockStreams:
    """For each block ``d`` seen so far, the calibration activations of the model without
    block ``d``, advanced through the blocks after it."""

    def __init__(self):
        self.streams: dict[int, list[torch.Tensor]] = {}

    def advance(self, index: int, block: nn.Module, inputs: BlockInputs) -> None:
        """Run block ``index`` on every stream that skipped an earlier block, then start
        the stream that skips this one: its input, handed on unchanged."""
        for d, hidden in self.streams.items():
            self.streams[d] = run_block(block, inputs.with_hidden(hidden))
        self.streams[index] = list(inputs.hidden)


def lm_loss(hidden: list[torch.Tensor], ids: list[torch.Tensor], norm: nn.Module, head: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) of the last block's outputs ``hidden`` (one
    tensor per calibration batch) through the final ``norm`` and the ``head`` weight
    ``[vocab, hidden]``, one sequence at a time (a ``[seq_len, vocab]`` logit table)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for h, batch in zip(hidden, ids):
            for row, target in zip(h, batch):
                logits = nn.functional.linear(norm(row.unsqueeze(0))[0], head)
                total += float(nn.functional.cross_entropy(logits[:-1].float(), target[1:], reduction="sum"))
                count += target.numel() - 1
    return total / max(1, count)
