"""The object a recipe's steps work on: the model being compressed and what has been
decided about its layers so far."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from compress.architectures import ArchSpec
from compress.io.schemes import QuantizedWeight

if TYPE_CHECKING:       # compress.recipe imports the registry, which imports the methods
    from compress.recipe import TrainingConfig


@dataclass
class CompressionState:
    model: nn.Module                    # a transformers *ForCausalLM, float
    arch: ArchSpec
    tokenizer: Any
    model_path: str
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)

    def record_quantized(self, name: str, module: nn.Linear, qw: QuantizedWeight) -> None:
        """Record layer ``name`` as quantized and replace its float weight by the
        dequantized one, so later steps and evaluations see the quantized function."""
        self.quantized[name] = qw
        with torch.no_grad():
            module.weight.copy_(qw.dequantize().to(module.weight.dtype))


@dataclass
class StepContext:
    where: str                                   # "recipe.yaml: stage 'x' step 2 (awq)"
    calibration: Callable[[], torch.Tensor]      # lazily loaded token ids [samples, seq_len]
    seed: int = 0
    progress: bool = True
    stats: dict = field(default_factory=dict)    # what a step measured, by method (kept in the stage result)
    # the teacher model's directory (distillation): the stage's source unless the step names
    # one (recipe 'teacher:', resolved by compress/recipe.py to TeacherRef.directory)
    teacher: str | None = None
    # the recipe's 'training:' section (compress/recipe.py TrainingConfig) with absolute file
    # paths, or None when the recipe has none (distillation then uses its default text)
    training: TrainingConfig | None = None
