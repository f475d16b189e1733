"""The prune step as the stage executor runs it: importance pass, choice, streamed cut.

``PruneTransform(model, arch, config, ctx)`` checks the targets against the model it is
given (on ``meta``) and dry-runs the cut on the shapes alone, so a bad target fails
before any work; ``run`` then measures what the strategy needs, chooses the kept
indices and writes the smaller model tensor by tensor. See ``pruning/prune.py``.
"""
from __future__ import annotations

import math

import torch

from compress.config import ConfigError
from compress.errors import StepError
from compress.stage_executor import ModelTransform
from pruning.cut import KeptIndices, check_shapes, plan_cut, planned_shapes, stream_cut
from pruning.importance import Importance, measure_importance
from pruning.prune import PruneConfig, TargetShape, current_shape, target_shape
from pruning.selection import choose_heads, random_k, top_k


class PruneTransform(ModelTransform):
    def __init__(self, model, arch, config: PruneConfig, ctx):
        self.config, self.where, self.progress, self.stats = config, ctx.where, ctx.progress, ctx.stats
        self.seed = ctx.seed if config.seed is None else config.seed
        self.before = current_shape(model.config)
        self.shape = target_shape(model.config, config.targets, ctx.where)
        # the cut on the shapes alone: a config that cannot describe the result fails here
        dry = plan_cut(arch, model.config, first_indices(self.before, self.shape))
        try:
            check_shapes(dry.config, planned_shapes(arch, {n: list(p.shape) for n, p in model.named_parameters()},
                                                    dry))
        except ValueError as exc:
            key = "hidden_size" if config.targets.hidden_size is not None else "targets"
            raise ConfigError(f"the pruned shape cannot be described by a {type(model.config).__name__}: {exc}",
                              f"{ctx.where}.targets" + (f".{key}" if key != "targets" else "")) from None

    def measures(self) -> set[str]:
        """What the importance pass must measure for the sizes that change."""
        if self.config.strategy != "importance":
            return set()
        b, s = self.before, self.shape
        wanted = set()
        if s.num_hidden_layers < b.num_hidden_layers:
            wanted.add(self.config.depth_metric)
        if s.intermediate_size < b.intermediate_size:
            wanted.add("mlp")
        if (s.num_attention_heads, s.num_key_value_heads) != (b.num_attention_heads, b.num_key_value_heads):
            wanted.add("heads")
        if s.hidden_size < b.hidden_size:
            wanted.add("hidden")
        return wanted

    def run(self, source, skeleton, arch, calibration, writer):
        if source.groups:
            raise StepError(f"{self.where}: {source.directory} holds quantized layers "
                            f"({next(iter(source.groups))}, ...); prune works on a float model")
        measures = self.measures()
        found = None
        if measures:
            found = measure_importance(skeleton, arch, source, calibration(), measures, self.config.batch_size,
                                       self.config.sequence_aggregation, self.config.sample_aggregation,
                                       self.progress)
        kept = choose(self.before, self.shape, found, self.config.depth_metric, torch.Generator().manual_seed(self.seed))
        plan = plan_cut(arch, skeleton.config, kept)
        written = stream_cut(source, arch, plan, writer)
        self.stats["prune"] = summary(self.config.strategy, self.before, self.shape, kept, found,
                                      parameters_before=sum(p.numel() for p in skeleton.parameters()),
                                      parameters_after=_numel(written))
        return plan.config


def choose(before: TargetShape, shape: TargetShape, found: Importance | None, depth_metric: str,
           generator: torch.Generator) -> KeptIndices:
    """The kept indices: top-k of ``found``'s scores, or (``found`` None) seeded random
    draws in a fixed order -- blocks, MLP channels, heads, hidden channels."""
    kept = KeptIndices()
    layers = before.num_hidden_layers
    if shape.num_hidden_layers < layers:
        if found is None:
            kept.blocks = random_k(layers, shape.num_hidden_layers, generator)
        else:
            scores = found.block_importance if depth_metric == "block_importance" else found.lm_loss_increase
            kept.blocks = top_k(scores, shape.num_hidden_layers)
    rows = kept.blocks if kept.blocks is not None else torch.arange(layers)
    if shape.intermediate_size < before.intermediate_size:
        kept.mlp = (random_k(before.intermediate_size, shape.intermediate_size, generator, rows=len(rows))
                    if found is None else top_k(found.mlp[rows], shape.intermediate_size))
    if (shape.num_attention_heads, shape.num_key_value_heads) != (before.num_attention_heads,
                                                                  before.num_key_value_heads):
        kept.heads = choose_heads(None if found is None else found.heads[rows], len(rows),
                                  before.num_attention_heads, before.num_key_value_heads,
                                  shape.num_attention_heads, shape.num_key_value_heads, generator)
    if shape.hidden_size < before.hidden_size:
        kept.hidden = (random_k(before.hidden_size, shape.hidden_size, generator)
                       if found is None else top_k(found.hidden(rows), shape.hidden_size))
    return kept


def first_indices(before: TargetShape, shape: TargetShape) -> KeptIndices:
    """Stand-in indices of the target shape (the first ones), for the dry run of the cut."""
    return choose(before, shape, _uniform(before), "block_importance", torch.Generator())


def _uniform(before: TargetShape) -> Importance:
    layers = before.num_hidden_layers
    return Importance(mlp=torch.zeros(layers, before.intermediate_size),
                      heads=torch.zeros(layers, before.num_attention_heads),
                      hidden_blocks=torch.zeros(layers, before.hidden_size),
                      hidden_final=torch.zeros(before.hidden_size), block_importance=torch.zeros(layers))


def _numel(written: dict[str, list]) -> int:
    return sum(math.prod(shape) for shape in written.values())


def summary(strategy: str, before: TargetShape, shape: TargetShape, kept: KeptIndices, found: Importance | None,
            parameters_before: int, parameters_after: int) -> dict:
    out = {"strategy": strategy, "parameters_before": parameters_before, "parameters_after": parameters_after,
           "before": before.__dict__, "after": shape.__dict__}
    if kept.blocks is not None:
        out["kept_blocks"] = kept.blocks.tolist()
    if found is not None and found.block_importance is not None:
        out["block_importance"] = [round(float(v), 6) for v in found.block_importance]
    if found is not None and found.lm_loss_increase is not None:
        out["lm_loss"] = found.lm_loss
        out["lm_loss_increase"] = [round(float(v), 6) for v in found.lm_loss_increase]
    return out
