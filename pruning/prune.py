"""``method: prune``: Minitron-style structural pruning to a smaller dense model.

A recipe step::

    - method: prune
      targets: {intermediate_size: 1408, num_attention_heads: 8, num_hidden_layers: 20}
      strategy: importance          # or random: seeded indices, same shapes (the control)

``targets`` names the sizes wanted, any of ``hidden_size``, ``intermediate_size``,
``num_attention_heads`` (query heads removed uniformly within each kv group),
``num_key_value_heads`` (whole kv groups with their query heads) and
``num_hidden_layers``; what it leaves out stays as it is. ``head_dim`` never changes
(RoPE is untouched), and every block keeps the same sizes, so a vanilla config
describes the result.

The step is a transform (``compress/stage_executor.py`` ModelTransform, in
``pruning/transform.py``): it runs first in its stage, measures importance in one
calibrated pass over the blocks (``pruning/importance.py``), chooses the kept indices
(``pruning/selection.py``) and streams every tensor through the cut
(``pruning/cut.py``). This module holds what the recipe parser needs: the config and
the checks of the targets against a model's config.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from compress.config import ConfigError, check
from compress.errors import UserError
from pruning.channel_slices import attention_shape, smaller_config

TARGET_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "num_hidden_layers")


@dataclass
class PruneTargets:
    """The sizes wanted; None keeps a size as it is."""
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    num_hidden_layers: int | None = None

    def given(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def validate(self) -> None:
        for key, value in self.given().items():
            check(value >= 1, key, f"must be at least 1, got {value}")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv is not None:
            check(heads % kv == 0, "num_attention_heads",
                  f"{heads} query heads cannot be shared evenly by {kv} key/value heads (GQA: every kv "
                  f"head serves the same number of query heads); give a multiple of {kv}")


@dataclass
class PruneConfig:
    targets: PruneTargets = field(default_factory=PruneTargets)
    strategy: Literal["importance", "random"] = "importance"
    # importance of a channel: |activation| reduced over the sequence, then over the samples
    sequence_aggregation: Literal["mean", "l2", "max"] = "mean"
    sample_aggregation: Literal["l2", "mean", "max"] = "l2"
    # which blocks go (num_hidden_layers): lowest Block Importance (1 - cos(input, output)), or
    # the smallest calibration-loss increase when skipped (holds one activation stream per block)
    depth_metric: Literal["block_importance", "lm_loss"] = "block_importance"
    seed: int | None = None             # random strategy's draws (None: the recipe's seed)
    batch_size: int = 8                 # calibration sequences per forward

    def validate(self) -> None:
        check(bool(self.targets.given()), "targets",
              f"give at least one size to prune to: {', '.join(TARGET_KEYS)}")
        check(self.batch_size > 0, "batch_size", f"must be > 0, got {self.batch_size}")


@dataclass(frozen=True)
class TargetShape:
    """The pruned model's sizes (every one resolved, the unchanged ones included)."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int


def current_shape(model_config) -> TargetShape:
    heads, kv_heads, _ = attention_shape(model_config)
    return TargetShape(model_config.hidden_size, model_config.intermediate_size, heads, kv_heads,
                       model_config.num_hidden_layers)


def target_shape(model_config, targets: PruneTargets, where: str) -> TargetShape:
    """The sizes ``targets`` prunes ``model_config`` to; a ConfigError at
    ``<where>.targets.<key>`` for a size above the model's or a head layout GQA cannot hold."""
    now = current_shape(model_config)
    _check_bounds(now, targets, where)
    per_kv = now.num_attention_heads // now.num_key_value_heads
    kv = targets.num_key_value_heads or now.num_key_value_heads
    heads = targets.num_attention_heads or kv * per_kv
    key = f"{where}.targets.num_attention_heads"
    if heads % kv:
        if per_kv == 1 and targets.num_key_value_heads is None:
            raise ConfigError(f"{heads} query heads: every kv head here serves one query head (no GQA), so the kv "
                              f"heads go with them: set num_key_value_heads: {heads} too", key)
        raise ConfigError(f"{heads} query heads cannot be shared evenly by the {kv} key/value heads kept "
                          f"(GQA: every kv head serves the same number of query heads); give a multiple of {kv}",
                          key)
    if heads // kv > per_kv:
        raise ConfigError(f"{heads} query heads over {kv} kv heads would be {heads // kv} per kv head; the model "
                          f"has {per_kv} per kv head ({now.num_attention_heads} over {now.num_key_value_heads}), "
                          f"and pruning cannot add any: at most {kv * per_kv}", key)
    if targets.hidden_size is not None and targets.hidden_size != now.hidden_size:
        _check_head_layout(model_config, targets.hidden_size, heads, kv, f"{where}.targets.hidden_size")
    return TargetShape(targets.hidden_size or now.hidden_size,
                       targets.intermediate_size or now.intermediate_size, heads, kv,
                       targets.num_hidden_layers or now.num_hidden_layers)


def _check_head_layout(model_config, hidden: int, heads: int, kv: int, where: str) -> None:
    """The attention keeps ``head_dim`` (RoPE, the heads' weights) whatever the hidden size:
    the config class must carry an explicit ``head_dim`` rather than derive it as
    ``hidden_size // num_attention_heads``. Probed with the step's target head counts, as
    the pruned config will have them (a class may demand hidden_size % heads == 0)."""
    head_dim = attention_shape(model_config)[2]
    try:
        probe = smaller_config(model_config, {"hidden_size": hidden, "num_attention_heads": heads,
                                              "num_key_value_heads": kv, "head_dim": head_dim})
    except ValueError as exc:
        raise ConfigError(f"{hidden} with {heads} query heads: {exc}", where) from None
    got = attention_shape(probe)[2]
    if got != head_dim:
        raise ConfigError(f"{hidden} does not fit the head layout: {type(model_config).__name__} makes head_dim "
                          f"{got} from it, and pruning keeps head_dim {head_dim} (RoPE and every head's weights); "
                          f"this model type takes only hidden_size = num_attention_heads x {head_dim}", where)


def _check_bounds(now: TargetShape, targets: PruneTargets, where: str) -> None:
    for key, value in targets.given().items():
        have = getattr(now, key)
        if value > have:
            raise ConfigError(f"{value} exceeds the model's {key} of {have}; pruning only removes",
                              f"{where}.targets.{key}")


def check_prune_targets(model, config: PruneConfig, where: str) -> None:
    """The recipe's check against the base model (``compress run --dry-run``): sizes above
    the model's. The head layout is checked when the step starts, against the model the
    step receives (an earlier prune of the same chain may have changed its kv heads)."""
    _check_bounds(current_shape(model.config), config.targets, where)


def prune_step(model, arch, config: PruneConfig, ctx):
    """The registry's ``step``: the transform the stage executor runs (imported here, as
    the executor imports the registry)."""
    from pruning.transform import PruneTransform

    return PruneTransform(model, arch, config, ctx)


def apply_prune(state, config: PruneConfig, ctx) -> None:
    raise UserError(f"{ctx.where}: prune rewrites the model's shapes and runs in the stage executor "
                    "(compress run / compress_stages), not on a model held in memory")
