"""Round-to-nearest baselines: int8 W8A8 (per output channel, symmetric) and
groupwise or per-channel int4 W4A16 (asymmetric by default). No calibration data needed.

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
    group_size: int | str = 128       # int4: a multiple of 8, or "channel" / -1 (one scale per row)
    symmetric: bool = False
    targets: list[str] = field(default_factory=lambda: ["re:.*layers\\.\\d+\\..*"])
    ignore: list[str] = field(default_factory=list)

    def validate(self) -> None:
        problem = primitives.group_size_problem(self.group_size)
        check(problem is None, "group_size", problem or "")


def quantize_weight_rtn(weight: torch.Tensor, config: RTNConfig, name: str) -> QuantizedWeight:
    """The pure core: one float weight -> one QuantizedWeight."""
    primitives.check_finite(weight, name)
    if config.bits == 8:
        q, scale = primitives.quantize_int8_per_channel(weight)
        return QuantizedWeight("w8a8", {"qweight": q, "weight_scale": scale})
    primitives.check_group_size(weight.shape[1], config.group_size, name)
    group_size = primitives.resolve_group_size(config.group_size, weight.shape[1])
    qw, scales, zeros = primitives.quantize_int4_groupwise(weight, group_size, config.symmetric)
    return int4_quantized_weight(qw, scales, zeros, weight.shape[1], config.group_size, config.symmetric)


def int4_quantized_weight(qweight, scales, zeros, in_features: int, group_size: int | str,
                          symmetric: bool) -> QuantizedWeight:
    """The ``w4a16`` QuantizedWeight (RTN and AWQ alike); per channel it records
    ``strategy: channel`` (exported as compressed-tensors' channel strategy) and
    ``group_size = in_features``."""
    meta = {"group_size": primitives.resolve_group_size(group_size, in_features), "in_features": in_features,
            "symmetric": symmetric}
    if primitives.is_per_channel(group_size):
        meta["strategy"] = "channel"
    return QuantizedWeight("w4a16", {"qweight": qweight, "scales": scales, "zeros": zeros}, meta)


def apply_rtn(state, config: RTNConfig, ctx) -> None:
    """Quantize every targeted linear of ``state.model`` and record it in ``state.quantized``."""
    layers = select_linears(state.model, config.targets, config.ignore, ctx.where)
    for name, module in tqdm(layers, desc=f"rtn int{config.bits}", disable=not ctx.progress):
        state.record_quantized(name, module, quantize_weight_rtn(module.weight.data, config, name))
