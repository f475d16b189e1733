"""A recipe step as work on one decoder block at a time.

Every method (``quantizers/rtn.py``, ``llm_int8.py``, ``awq.py``) is a :class:`BlockStep`:
``start(model, arch, config, ctx)`` selects its layers on the model's module tree (which
may sit on the ``meta`` device: names and shapes only) and checks their shapes; then
``block(index, block, inputs, record)`` does the work on one materialised block, with
that block's calibration inputs when the step is calibrated, and hands each result to
``record(name, module, qweight)``. Linears outside the decoder blocks (``lm_head``) go
through ``outside_linear``; only uncalibrated methods take them.

Two drivers run the same steps: :func:`apply_whole_model` on a model held in memory
(``iterate_blocks``, one step after the other), and the stage executor
(``compress/stage_executor.py``), which streams a checkpoint block by block and runs
every step of a stage on a block before it reads the next one.
"""
from __future__ import annotations

from torch import nn

from compress.calibration import BlockInputs, iterate_blocks
from compress.config import ConfigError


class BlockStep:
    calibrated: bool = False
    batch_size: int = 8                       # calibration sequences per forward (calibrated steps)

    def __init__(self, per_block: dict[int, list[str]], outside: list[str]):
        self.per_block = per_block            # block index -> linears (relative to the block) it changes
        self.outside = outside                # full names of linears outside the blocks

    def block(self, index: int, block: nn.Module, inputs: BlockInputs | None, record) -> None:
        raise NotImplementedError

    def outside_linear(self, name: str, module: nn.Linear, record) -> None:
        raise NotImplementedError

    def finish(self, stats: dict) -> None:
        """Put what the step measured into the stage's stats (by method name)."""


def group_by_block(names: list[str], arch, method: str, where: str,
                   allow_outside: bool) -> tuple[dict[int, list[str]], list[str]]:
    """Split full linear names into ``{block index: [relative names]}`` and the names
    outside the decoder blocks; a calibrated method (``allow_outside=False``) cannot
    take the latter: that is a config error naming the layer."""
    prefix = arch.layers + "."
    per_block: dict[int, list[str]] = {}
    outside: list[str] = []
    for name in names:
        index, _, rel = name[len(prefix):].partition(".") if name.startswith(prefix) else ("", "", "")
        if index.isdigit() and rel:
            per_block.setdefault(int(index), []).append(rel)
        elif allow_outside:
            outside.append(name)
        else:
            raise ConfigError(f"{method} calibrates linears inside decoder blocks ({arch.layers}.N.*) only; "
                              f"{name!r} is outside them: add it to 'ignore' or narrow 'targets'",
                              f"{where}.targets" if where else "targets")
    return per_block, outside


def apply_whole_model(step: BlockStep, state, ctx) -> None:
    """Run ``step`` over ``state.model`` held in memory: block after block (with the
    calibration set flowing through the blocks as the step changes them), then the
    linears outside the blocks."""
    model, arch = state.model, state.arch
    blocks = model.get_submodule(arch.layers)
    if step.calibrated and step.per_block:
        walk = iterate_blocks(model, arch, ctx.calibration(), step.batch_size)
    else:
        walk = ((i, b, None) for i, b in enumerate(blocks))
    from tqdm.auto import tqdm

    for index, block, inputs in tqdm(walk, total=len(blocks), desc=type(step).__name__,
                                     disable=not ctx.progress):
        if index in step.per_block:
            step.block(index, block, inputs, state.record_quantized)
    for name in step.outside:
        step.outside_linear(name, model.get_submodule(name), state.record_quantized)
    step.finish(ctx.stats)
