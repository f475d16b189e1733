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
from tqdm.auto import tqdm

from compress.calibration import iterate_blocks
from compress.config import check
from quantizers import primitives
from quantizers.block_capture import block_targets, capture_inputs
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


def apply_llm_int8(state, config: LLMInt8Config, ctx) -> None:
    """Calibrate outlier columns block by block, then quantize each block's linears."""
    selected = select_linears(state.model, config.targets, config.ignore, ctx.where)
    per_block = block_targets(state.model, state.arch, selected, "llm_int8", ctx.where)
    for name, module in selected:
        primitives.check_finite(module.weight.data, name)
    ids = ctx.calibration()
    prefix = state.arch.layers
    stats = {"columns": 0, "outlier_columns": 0}
    blocks = iterate_blocks(state.model, state.arch, ids, config.batch_size)
    for index, block, inputs in tqdm(blocks, total=len(state.model.get_submodule(prefix)),
                                     desc="llm_int8", disable=not ctx.progress):
        linears = per_block.get(index)
        if not linears:
            continue
        absmax: dict[str, torch.Tensor] = {}

        def reduce(name, x):
            m = column_absmax(x)
            absmax[name] = m if name not in absmax else torch.maximum(absmax[name], m)

        capture_inputs(block, inputs, linears, reduce=reduce)
        for rel, module in linears.items():
            idx = find_outlier_columns(absmax[rel], config.threshold)
            dtype = module.weight.dtype if config.outlier_dtype == "auto" else getattr(torch, config.outlier_dtype)
            qw = quantize_llm_int8(module.weight.data, idx, config.threshold, dtype)
            state.record_quantized(f"{prefix}.{index}.{rel}", module, qw)
            stats["columns"] += module.in_features
            stats["outlier_columns"] += int(idx.numel())
    ctx.stats.setdefault("llm_int8", {}).update(
        stats, outlier_fraction=stats["outlier_columns"] / max(1, stats["columns"]))
