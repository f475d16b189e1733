"""Capturing what the modules inside one decoder block receive, with forward hooks.

Shared by the calibrated quantizers (llm_int8, awq). Works on one block and the
:class:`compress.calibration.BlockInputs` that ``iterate_blocks`` yields, so memory
stays near one block plus its calibration inputs.
"""
from __future__ import annotations

from typing import Callable, Collection

import torch
from torch import nn

from compress.calibration import BlockInputs, block_output, run_block


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


def capture_inputs_outputs(block: nn.Module, inputs: BlockInputs, modules: dict[str, nn.Module],
                           with_kwargs: Collection[str] = (), outputs: Collection[str] = ()
                           ) -> tuple[dict[str, list], dict[str, list[torch.Tensor]]]:
    """One forward of ``block`` catching, per batch, each named module's input (``(x, kwargs)``
    for the names in ``with_kwargs``, else ``x``) and, for the names in ``outputs``, its
    output (hidden states only). Tensors are kept as the block made them: a module that
    receives another's input or output shares its storage, not a copy."""
    seen: dict[str, list] = {n: [] for n in modules}
    made: dict[str, list[torch.Tensor]] = {n: [] for n in outputs}
    handles = []

    def pre_hook(name):
        def hook(_module, args, kwargs):
            x = (args[0] if args else kwargs["hidden_states"]).detach()
            if name in with_kwargs:
                seen[name].append((x, {k: v for k, v in kwargs.items() if k != "hidden_states"}))
            else:
                seen[name].append(x)
        return hook

    def post_hook(name):
        def hook(_module, _args, _kwargs, out):
            made[name].append(block_output(out).detach())
        return hook

    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(pre_hook(name), with_kwargs=True))
        if name in made:
            handles.append(module.register_forward_hook(post_hook(name), with_kwargs=True))
    try:
        run_block(block, inputs)
    finally:
        for h in handles:
            h.remove()
    return seen, made
