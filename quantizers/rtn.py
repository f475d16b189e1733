"""Round-to-nearest baselines: int8 W8A8 (per output channel, symmetric) and
groupwise or per-channel int4 W4A16 (asymmetric by default). No calibration data needed.

These are the baselines LLM.int8() and AWQ must beat.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from compress.block_steps import BlockStep, apply_whole_model, group_by_block
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


class RTNStep(BlockStep):
    def __init__(self, model, arch, config: RTNConfig, ctx):
        names = [n for n, _ in select_linears(model, config.targets, config.ignore, ctx.where)]
        super().__init__(*group_by_block(names, arch, "rtn", ctx.where, allow_outside=True))
        self.config, self.prefix = config, arch.layers

    def block(self, index, block, inputs, record) -> None:
        for rel in self.per_block[index]:
            self.outside_linear(f"{self.prefix}.{index}.{rel}", block.get_submodule(rel), record)

    def outside_linear(self, name, module, record) -> None:
        record(name, module, quantize_weight_rtn(module.weight.data, self.config, name))


def apply_rtn(state, config: RTNConfig, ctx) -> None:
    """Quantize every targeted linear of ``state.model`` and record it in ``state.quantized``."""
    apply_whole_model(RTNStep(state.model, state.arch, config, ctx), state, ctx)
