"""Helpers shared by the quantizer tests (tiny models, planted outliers)."""
import copy

import torch

from tiny_models import tiny_config


def build_tiny(family: str = "llama", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()


@torch.no_grad()
def plant_norm_outliers(model, arch, channels, factor):
    """Make ``channels`` of every norm output ``factor`` x larger, function unchanged."""
    from quantizers.awq_search import fold_scale_into_norm

    s = torch.ones(model.config.hidden_size)
    s[list(channels)] = 1.0 / factor
    for block in model.get_submodule(arch.layers):
        for g in arch.scale_groups:
            if g.prev_kind == "norm":
                fold_scale_into_norm(block.get_submodule(g.prev).weight.data,
                                     [block.get_submodule(n).weight.data for n in g.linears], s)
    return model


def run_method(model, family, apply, config, ids):
    from compress.architectures import get_arch
    from compress.state import CompressionState, StepContext

    state = CompressionState(copy.deepcopy(model), get_arch(family), None, "")
    ctx = StepContext(where="test step", calibration=lambda: ids, progress=False)
    apply(state, config, ctx)
    return state, ctx


def rel_err(a, b):
    return float((a - b).norm() / b.norm())
