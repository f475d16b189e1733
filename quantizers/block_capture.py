"""Capturing what the modules inside one decoder block receive, with forward hooks.

Shared by the calibrated quantizers (llm_int8, awq). Works on one block and the
:class:`compress.calibration.BlockInputs` that ``iterate_blocks`` yields, so memory
stays near one block plus its calibration inputs.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from compress.calibration import BlockInputs, run_block


def capture_inputs(block: nn.Module, inputs: BlockInputs, modules: dict[str, nn.Module],
                   reduce: Callable[[str, torch.Tensor], None] | None = None,
                   with_kwargs: bool = False) -> dict[str, list]:
    """Run ``block`` on the calibration inputs, catching each named module's input.

    With ``reduce`` the input tensors are handed to ``reduce(name, x)`` and not kept
    (statistics only); otherwise returns ``{name: [x per batch]}`` (or ``[(x, kwargs)]``
    with ``with_kwargs``).
    """
    seen: dict[str, list] = {n: [] for n in modules}
    handles = []

    def make_hook(name):
        def hook(_module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if reduce is not None:
                reduce(name, x)
            elif with_kwargs:
                seen[name].append((x.detach(), {k: v for k, v in kwargs.items() if k != "hidden_states"}))
            else:
                seen[name].append(x.detach())
        return hook

    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(make_hook(name), with_kwargs=True))
    try:
        run_block(block, inputs)
    finally:
        for h in handles:
            h.remove()
    return seen
