"""How much memory a ``compress run`` needs, checked before any work.

The stage executor holds one decoder block in float32 at a time, plus the working
tensors of the step on it, the embedding while the calibration set is embedded, and the
calibration activations. :func:`estimate` adds those up from the model's shapes (on the
``meta`` skeleton) and the recipe; :func:`check_memory` refuses a run whose estimate is
more than the memory available, with the estimate and its parts in the message.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from compress.errors import UserError

GB = 1e9
INTERPRETER_BYTES = int(0.7 * GB)      # python + torch + transformers + our extension, measured ~0.6 GB
FLOAT32 = 4


class MemoryEstimateError(UserError):
    pass


@dataclass
class MemoryEstimate:
    block: int              # the largest block in float32
    step_work: int          # temporaries of the heaviest step on that block
    embedding: int          # the embedding (or a head) in float32 while it is used
    activations: int        # calibration activations alive at once
    interpreter: int = INTERPRETER_BYTES

    @property
    def total(self) -> int:
        return self.block + self.step_work + self.embedding + self.activations + self.interpreter

    def describe(self) -> str:
        return (f"{self.total / GB:.1f} GB (a float32 block {self.block / GB:.2f} GB, step work "
                f"{self.step_work / GB:.2f} GB, embedding {self.embedding / GB:.2f} GB, calibration activations "
                f"{self.activations / GB:.2f} GB, interpreter {self.interpreter / GB:.1f} GB)")


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def estimate(recipe, skeleton: nn.Module, arch) -> MemoryEstimate:
    config = skeleton.config
    blocks = skeleton.get_submodule(arch.layers)
    block = max((_numel(b) for b in blocks), default=0) * FLOAT32
    largest_linear = max((m.weight.numel() for m in blocks.modules() if isinstance(m, nn.Linear)), default=0)
    embed = skeleton.get_submodule(arch.embed_tokens).weight.numel() * FLOAT32
    methods = {s.method for st in recipe.stages for s in st.steps}
    calibrated_steps = max((sum(s.method in ("awq", "llm_int8", "prune") for s in st.steps) for st in recipe.stages),
                           default=0)
    if any(s.method == "prune" and getattr(s.config, "depth_metric", None) == "lm_loss"
           for st in recipe.stages for s in st.steps):
        calibrated_steps += config.num_hidden_layers     # one stream per block for the loss of skipping it
    # quantizing one linear makes a few weight-sized float temporaries; AWQ's search holds
    # candidates for a whole scale group (q/k/v or gate/up) besides
    step_work = 4 * largest_linear * FLOAT32 + (3 * largest_linear * FLOAT32 if "awq" in methods else 0)
    activations = 0
    if calibrated_steps:
        tokens = recipe.calibration.samples * recipe.calibration.seq_len
        hidden, inter = config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size)
        # one hidden stream per calibrated step + the block's outputs + the widest captured input
        activations = tokens * FLOAT32 * (hidden * (calibrated_steps + 2) + 2 * inter)
        if "awq" in methods:   # AWQ catches a whole block's inner activations in one forward
            activations += tokens * FLOAT32 * (6 * hidden + inter)
    return MemoryEstimate(block, step_work, embed, activations)


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# set (to 1) by ``compress run --ignore-memory-check``: the estimate is an upper bound
# (measured peaks ran at 0.5-0.8x of it), so a run refused by a small margin may still fit
IGNORE_ENV = "COMPRESS_IGNORE_MEMORY_CHECK"


def memory_check_ignored() -> bool:
    import os

    return os.environ.get(IGNORE_ENV, "").lower() in ("1", "true", "yes", "on")


def check_estimate(recipe, est: MemoryEstimate, free: int | None) -> None:
    """A MemoryEstimateError when ``est`` passes the ``free`` bytes (unless ignored)."""
    if free is not None and est.total > free and not memory_check_ignored():
        raise MemoryEstimateError(
            f"{recipe.path}: compressing this model needs about {est.describe()}, and this machine has "
            f"{free / GB:.1f} GB available. Fewer calibration samples or a shorter seq_len shrink the "
            "activations; the block itself cannot shrink. The estimate is an upper bound: "
            f"`compress run --ignore-memory-check` ({IGNORE_ENV}=1) runs it anyway.")


def check_memory(recipe, skeleton: nn.Module, arch, log=print) -> MemoryEstimate:
    est = estimate(recipe, skeleton, arch)
    free = available_bytes()
    check_estimate(recipe, est, free)
    log(f"memory estimate: {est.describe()}" + (f"; {free / GB:.1f} GB available" if free else "")
        + ("; the check is ignored" if memory_check_ignored() and free is not None and est.total > free else ""))
    return est
