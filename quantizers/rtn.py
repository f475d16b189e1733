"""Round-to-nearest baselines: int8 W8A8 (per output channel, symmetric) and
groupwise int4 W4A16 (asymmetric by default). No calibration data needed.

These are the baselines LLM.int8() and AWQ must beat.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from tqdm.auto import tqdm

from compress.config import check
from compress.io.schemes import QuantizedWeight
from quantizers import primitives
from quantizers.targets import select_linears


@dataclass
class RTNConfig:
    bits: Literal[4, 8] = 4
    group_size: int = 128
    symmetric: bool = False
    targets: list[str] = field(default_factory=lambda: ["re:.*layers\\.\\d+\\..*"])
    ignore: list[str] = field(default_factory=list)

    def validate(self) -> None:
        check(self.group_size > 0 and self.group_size % 8 == 0, "group_size",
              f"must be a positive multiple of 8, got {self.group_size}")


def quantize_weight_rtn(weight: torch.Tensor, config: RTNConfig, name: str) -> QuantizedWeight:
    """The pure core: one float weight -> one QuantizedWeight."""
    primitives.check_finite(weight, name)
    if config.bits == 8:
        q, scale = primitives.quantize_int8_per_channel(weight)
        return QuantizedWeight("w8a8", {"qweight": q, "weight_scale": scale})
    primitives.check_group_size(weight.shape[1], config.group_size, name)
    qw, scales, zeros = primitives.quantize_int4_groupwise(weight, config.group_size, config.symmetric)
    return QuantizedWeight("w4a16", {"qweight": qw, "scales": scales, "zeros": zeros},
                           {"group_size": config.group_size, "in_features": weight.shape[1],
                            "symmetric": config.symmetric})


def apply_rtn(state, config: RTNConfig, ctx) -> None:
    """Quantize every targeted linear of ``state.model`` and record it in ``state.quantized``."""
    layers = select_linears(state.model, config.targets, config.ignore, ctx.where)
    for name, module in tqdm(layers, desc=f"rtn int{config.bits}", disable=not ctx.progress):
        state.record_quantized(name, module, quantize_weight_rtn(module.weight.data, config, name))
