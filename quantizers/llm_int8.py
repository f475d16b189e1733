"""``method: llm_int8``: LLM.int8() mixed-precision decomposition, calibrated.

Calibration runs the calibration set through the model one decoder block at a time;
forward hooks on the block's targeted linears record each input feature's largest
magnitude. Features reaching ``threshold`` (default 6.0, as in the paper) become that
linear's static outlier columns, kept in float; everything else is vector-wise int8
(per output row weights, per token activations at run time). See
``quantizers/outliers.py`` for the pure core and why the set is static.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from compress.block_steps import BlockStep, apply_whole_model, group_by_block
from compress.config import check
from quantizers import primitives
from quantizers.block_capture import capture_inputs
from quantizers.outliers import column_absmax, find_outlier_columns, quantize_llm_int8
from quantizers.targets import select_linears


@dataclass
class LLMInt8Config:
    threshold: float = 6.0
    targets: list[str] = field(default_factory=lambda: ["re:.*layers\\.\\d+\\..*"])
    ignore: list[str] = field(default_factory=list)
    batch_size: int = 8          # calibration sequences per forward
    # storage of the float outlier columns: float16 as bitsandbytes keeps them (half the
    # bytes of float32; the fused op accumulates in fp32 either way); "auto" = the weight's dtype
    outlier_dtype: Literal["float16", "bfloat16", "float32", "auto"] = "float16"

    def validate(self) -> None:
        check(self.threshold > 0, "threshold", f"must be > 0, got {self.threshold}")
        check(self.batch_size > 0, "batch_size", f"must be > 0, got {self.batch_size}")


class LLMInt8Step(BlockStep):
    """Per block: the input columns' largest magnitudes over the calibration set, then
    each targeted linear quantized with its outlier columns."""
    calibrated = True

    def __init__(self, model, arch, config: LLMInt8Config, ctx):
        names = [n for n, _ in select_linears(model, config.targets, config.ignore, ctx.where)]
        super().__init__(*group_by_block(names, arch, "llm_int8", ctx.where, allow_outside=False))
        self.config, self.prefix, self.batch_size = config, arch.layers, config.batch_size
        self.stats = {"columns": 0, "outlier_columns": 0}

    def block(self, index, block, inputs, record) -> None:
        linears = {rel: block.get_submodule(rel) for rel in self.per_block[index]}
        for rel, module in linears.items():
            primitives.check_finite(module.weight.data, f"{self.prefix}.{index}.{rel}")
        absmax: dict[str, torch.Tensor] = {}

        def reduce(name, x):
            m = column_absmax(x)
            absmax[name] = m if name not in absmax else torch.maximum(absmax[name], m)

        capture_inputs(block, inputs, linears, reduce=reduce)
        config = self.config
        for rel, module in linears.items():
            idx = find_outlier_columns(absmax[rel], config.threshold)
            dtype = module.weight.dtype if config.outlier_dtype == "auto" else getattr(torch, config.outlier_dtype)
            qw = quantize_llm_int8(module.weight.data, idx, config.threshold, dtype)
            record(f"{self.prefix}.{index}.{rel}", module, qw)
            self.stats["columns"] += module.in_features
            self.stats["outlier_columns"] += int(idx.numel())

    def finish(self, stats: dict) -> None:
        s = self.stats
        stats.setdefault("llm_int8", {}).update(s, outlier_fraction=s["outlier_columns"] / max(1, s["columns"]))


def apply_llm_int8(state, config: LLMInt8Config, ctx) -> None:
    """Calibrate outlier columns block by block, then quantize each block's linears."""
    apply_whole_model(LLMInt8Step(state.model, state.arch, config, ctx), state, ctx)
