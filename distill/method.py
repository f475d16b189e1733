"""What the registry needs of ``method: distill`` (the transform itself is imported
lazily: the stage executor imports the registry)."""
from __future__ import annotations

from compress.errors import UserError
from distill.config import DistillConfig

__all__ = ["DistillConfig", "distill_step", "apply_distill"]


def distill_step(model, arch, config: DistillConfig, ctx):
    """The registry's ``step``: the transform the stage executor runs."""
    from distill.transform import DistillTransform

    return DistillTransform(model, arch, config, ctx)


def apply_distill(state, config: DistillConfig, ctx) -> None:
    raise UserError(f"{ctx.where}: distill trains the model from its files and runs in the stage executor "
                    "(compress run / compress_stages), not on a model held in memory")
