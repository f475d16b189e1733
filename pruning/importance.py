"""Importance of attention heads, MLP channels, hidden channels and blocks from
calibration activations (Muralidharan et al. 2024, "Compact Language Models via Pruning
and Knowledge Distillation", section 2.2), measured in one pass over the decoder blocks.

Each block is read from the source into the ``meta`` skeleton, the calibration batches
run through it with forward hooks that reduce what they see to per-channel statistics
at once (nothing is kept but ``[channels]`` vectors), and the block is put back on
``meta``; its outputs are the next block's inputs. Memory: one float32 block, the
calibration activations entering and leaving it, and the embedding while the
calibration set is embedded -- never the model.

* MLP channel ``i`` of a block: the ``i``-th input of ``down_proj``;
* query head ``h``: the L2 norm over ``head_dim`` of its slice of ``o_proj``'s input
  (the head's attention output), per token;
* hidden channel ``i``: the ``i``-th output of ``input_layernorm`` and of
  ``post_attention_layernorm`` summed over the blocks kept, plus the final norm's;
* block: Block Importance, and optionally the LM loss increase when it is skipped
  (``pruning/depth.py``).

Aggregation (:class:`ChannelScore`): ``|x|`` reduced over the sequence (``mean``,
``l2`` or ``max``), then over the calibration samples (``l2``, ``mean`` or ``max``).
The paper's best: mean over the sequence, L2 over the batch -- the default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

import torch
from torch import nn

from compress.calibration import advance, block_output
from compress.model_source import ModelSource
from compress.stage_executor import COMPUTE_DTYPE, Materializer, first_block_inputs
from pruning.channel_slices import attention_shape
from pruning.depth import BlockImportance, SkippedBlockStreams, lm_loss

SEQUENCE_REDUCTIONS = ("mean", "l2", "max")
SAMPLE_REDUCTIONS = ("l2", "mean", "max")
MEASURES = ("mlp", "heads", "hidden", "block_importance", "lm_loss")


class ChannelScore:
    """Per-channel importance of activations ``[batch, seq, channels]`` seen batch by batch."""

    def __init__(self, sequence: str = "mean", samples: str = "l2"):
        if sequence not in SEQUENCE_REDUCTIONS or samples not in SAMPLE_REDUCTIONS:
            raise ValueError(f"unknown aggregation {sequence!r} over the sequence / {samples!r} over samples")
        self.sequence, self.samples = sequence, samples
        self.acc: torch.Tensor | None = None
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        # |x| reduced over the sequence in the activations' dtype (no |x| temporary), [batch, channels]
        order = {"mean": 1, "l2": 2, "max": float("inf")}[self.sequence]
        per_sample = torch.linalg.vector_norm(x.detach(), ord=order, dim=1).to(torch.float64)
        if self.sequence == "mean":
            per_sample /= x.shape[1]
        if self.samples == "l2":
            part = per_sample.pow(2).sum(dim=0)
        elif self.samples == "mean":
            part = per_sample.sum(dim=0)
        else:
            part = per_sample.amax(dim=0)
        if self.acc is None:
            self.acc = part
        else:
            self.acc = torch.maximum(self.acc, part) if self.samples == "max" else self.acc + part
        self.count += per_sample.shape[0]

    def value(self) -> torch.Tensor:
        if self.acc is None:
            raise ValueError("no activations were seen")
        if self.samples == "l2":
            return self.acc.sqrt().float()
        if self.samples == "mean":
            return (self.acc / self.count).float()
        return self.acc.float()


def head_norms(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``o_proj``'s input ``[batch, seq, heads * head_dim]`` -> each head's output norm ``[batch, seq, heads]``."""
    return x.unflatten(-1, (-1, head_dim)).float().norm(dim=-1)


@dataclass
class Importance:
    """Scores by block (rows in block order); None for what was not measured."""
    mlp: torch.Tensor | None = None                 # [layers, intermediate_size]
    heads: torch.Tensor | None = None               # [layers, num_attention_heads]
    hidden_blocks: torch.Tensor | None = None       # [layers, hidden_size]: both norms' outputs of a block
    hidden_final: torch.Tensor | None = None        # [hidden_size]: the final norm's outputs
    block_importance: torch.Tensor | None = None    # [layers]
    lm_loss_increase: torch.Tensor | None = None    # [layers]
    lm_loss: float | None = None                    # the full model's calibration loss

    def hidden(self, kept_blocks: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden channels' importance over the blocks kept (all by default) and the final norm."""
        rows = self.hidden_blocks if kept_blocks is None else self.hidden_blocks[kept_blocks]
        return rows.sum(dim=0) + self.hidden_final


def measure_importance(skeleton: nn.Module, arch, source: ModelSource, ids: torch.Tensor,
                       measures: Collection[str], batch_size: int = 8, sequence: str = "mean",
                       samples: str = "l2", progress: bool = False) -> Importance:
    """One calibrated pass over the blocks of ``source`` measuring ``measures`` (a subset
    of :data:`MEASURES`) on calibration token ids ``ids`` ``[samples, seq_len]``."""
    from tqdm.auto import tqdm

    unknown = set(measures) - set(MEASURES)
    if unknown:
        raise ValueError(f"unknown importance measure(s) {sorted(unknown)}; known: {', '.join(MEASURES)}")
    _, _, head_dim = attention_shape(skeleton.config)
    loader = Materializer(skeleton, source)
    blocks = skeleton.get_submodule(arch.layers)
    inputs = first_block_inputs(skeleton, arch, source, ids, batch_size)
    rows: dict[str, list[torch.Tensor]] = {m: [] for m in ("mlp", "heads", "hidden_blocks")}
    bi: list[float] = []
    skipped = SkippedBlockStreams() if "lm_loss" in measures else None

    for index, block in enumerate(tqdm(blocks, desc="prune: importance", unit="block", disable=not progress)):
        loader.load(block, arch.block_prefix(index))
        scores: dict[str, ChannelScore] = {}
        hooks = []

        def score(key: str, x: torch.Tensor) -> None:
            if key not in scores:
                scores[key] = ChannelScore(sequence, samples)
            scores[key].update(x)

        if "mlp" in measures:
            hooks.append(block.get_submodule(arch.down_proj).register_forward_pre_hook(
                lambda _m, args: score("mlp", args[0])))
        if "heads" in measures:
            hooks.append(block.get_submodule(arch.o_proj).register_forward_pre_hook(
                lambda _m, args: score("heads", head_norms(args[0], head_dim))))
        if "hidden" in measures:
            for norm in (arch.attn_norm, arch.mlp_norm):
                hooks.append(block.get_submodule(norm).register_forward_hook(
                    lambda _m, _args, out, norm=norm: score(norm, block_output(out))))
        try:
            outputs = advance(block, inputs, index, arch)
        finally:
            for h in hooks:
                h.remove()
        if skipped is not None:
            skipped.advance(index, block, inputs)
        loader.release(block)
        if "mlp" in measures:
            rows["mlp"].append(scores["mlp"].value())
        if "heads" in measures:
            rows["heads"].append(scores["heads"].value())
        if "hidden" in measures:
            rows["hidden_blocks"].append(scores[arch.attn_norm].value() + scores[arch.mlp_norm].value())
        if "block_importance" in measures:
            meter = BlockImportance()
            for x, y in zip(inputs.hidden, outputs.hidden):
                meter.update(x, y)
            bi.append(meter.value())
        inputs = outputs

    found = Importance(**{k: torch.stack(v) for k, v in rows.items() if v})
    if bi:
        found.block_importance = torch.tensor(bi)
    if "hidden" in measures or skipped is not None:
        _after_the_blocks(skeleton, arch, source, loader, inputs.hidden, ids.split(batch_size), found,
                          skipped, sequence, samples)
    return found


def _after_the_blocks(skeleton, arch, source, loader, hidden, id_batches, found: Importance,
                      skipped: SkippedBlockStreams | None, sequence: str, samples: str) -> None:
    """The final norm's output scores, and the loss of the full model and of each model
    with one block skipped."""
    norm = skeleton.get_submodule(arch.final_norm)
    loader.load(norm, arch.final_norm)
    try:
        with torch.no_grad():
            if found.hidden_blocks is not None:
                final = ChannelScore(sequence, samples)
                for h in hidden:
                    final.update(norm(h))
                found.hidden_final = final.value()
            if skipped is not None:
                # the head read as a tensor, not loaded into the skeleton: that would untie
                # a tied head from the embedding in the (shared) skeleton
                param = skeleton.get_submodule(arch.lm_head).weight
                head = source.weight(loader.source_name(f"{arch.lm_head}.weight", param), COMPUTE_DTYPE)
                found.lm_loss = lm_loss(hidden, id_batches, norm, head)
                found.lm_loss_increase = torch.tensor(
                    [lm_loss(skipped.streams[d], id_batches, norm, head) - found.lm_loss
                     for d in range(len(skipped.streams))])
    finally:
        loader.release(norm)
