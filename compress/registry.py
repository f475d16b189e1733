"""The one registry of recipe methods: method name -> (config class, apply function).

Adding a method means adding one line here. ``step(model, arch, config, ctx)`` makes the
:class:`compress.block_steps.BlockStep` that the stage executor runs block by block;
``apply(state, config, ctx)`` runs the same step on a model held in memory (mutating
the :class:`compress.state.CompressionState` in place).

``kind`` says whether a method transforms the float model ('transform': prune, distill)
or quantizes it ('quantize': rtn, awq, llm_int8); the recipe parser refuses a transform
after a quantizing step in one chain of stages. ``uses_teacher``: its step may name a
``teacher:`` (an earlier stage or a model directory), given to it as ``StepContext.teacher``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

from distill.method import DistillConfig, apply_distill, distill_step
from pruning.prune import PruneConfig, apply_prune, check_prune_targets, prune_step
from quantizers.awq import AWQConfig, AWQStep, apply_awq
from quantizers.llm_int8 import LLMInt8Config, LLMInt8Step, apply_llm_int8
from quantizers.rtn import RTNConfig, RTNStep, apply_rtn
from quantizers.shape_checks import check_int4_group_size, check_targets


@dataclass(frozen=True)
class Method:
    name: str
    config_class: type
    apply: Callable
    step: Callable                      # (model, arch, config, ctx) -> BlockStep
    needs_calibration: bool
    description: str
    # check_model(meta_model, config, where): raises ConfigError when the model's shapes
    # cannot take this config (compress.preflight; the model is on the meta device)
    check_model: Callable | None = None
    kind: Literal["transform", "quantize"] = field(kw_only=True)
    uses_teacher: bool = field(default=False, kw_only=True)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("rtn", RTNConfig, apply_rtn, RTNStep, False,
           "round-to-nearest: int8 per-channel W8A8 or groupwise / per-channel int4 W4A16",
           check_int4_group_size, kind="quantize"),
    Method("llm_int8", LLMInt8Config, apply_llm_int8, LLMInt8Step, True,
           "LLM.int8(): vector-wise int8 with calibrated outlier input columns kept in float",
           check_targets, kind="quantize"),
    Method("awq", AWQConfig, apply_awq, AWQStep, True,
           "AWQ: activation-aware scales folded into the previous op, clip search, "
           "groupwise / per-channel int4 W4A16", check_int4_group_size, kind="quantize"),
    Method("prune", PruneConfig, apply_prune, prune_step, True,
           "Minitron structural pruning: hidden / MLP / heads / blocks cut by calibrated importance "
           "(or seeded random indices) to a smaller dense model", check_prune_targets, kind="transform"),
    Method("distill", DistillConfig, apply_distill, distill_step, False,
           "knowledge distillation healing: the model trained on a frozen teacher's logits (KL / CE / "
           "hidden-state loss), AdamW + cosine, resumable checkpoints, DDP under torchrun",
           kind="transform", uses_teacher=True),
)}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; registered methods: {', '.join(sorted(METHODS))}") from None
