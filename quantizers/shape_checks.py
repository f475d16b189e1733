"""Checks of a step's config against the model's shapes before any weight is loaded
(``Method.check_model``, run by ``compress run`` and ``--dry-run`` through
``compress/preflight.py``). The model may live on the ``meta`` device: only module
names and shapes are read."""
from __future__ import annotations

from torch import nn

from compress.config import ConfigError
from quantizers.primitives import indivisible_message, is_per_channel
from quantizers.targets import select_linears


def check_targets(model: nn.Module, config, where: str) -> None:
    """The step's ``targets`` / ``ignore`` patterns select linears of this model."""
    select_linears(model, config.targets, config.ignore, where)


def check_int4_group_size(model: nn.Module, config, where: str) -> None:
    """Every linear an int4 step targets has in_features divisible by its ``group_size``
    (per channel takes any shape); the error names the step, the key, the first such
    layer and its in_features."""
    layers = select_linears(model, config.targets, config.ignore, where)
    if getattr(config, "bits", 4) != 4 or is_per_channel(config.group_size):
        return
    bad = [(name, m.in_features) for name, m in layers if m.in_features % config.group_size]
    if bad:
        name, in_features = bad[0]
        raise ConfigError(indivisible_message(name, in_features, config.group_size, len(bad) - 1),
                          f"{where}.group_size" if where else "group_size")
