"""The one base class of "bad input" errors: the CLI shows any :class:`UserError` as one
clear line naming what is wrong and where (file, stage, step, key, tensor), not a
traceback. Every module's own error type (``ConfigError``, ``CheckpointError``, ...)
derives from it; this module imports nothing of the package, so any module can."""
from __future__ import annotations


class UserError(ValueError):
    """Bad input from the user: a recipe, a checkpoint, a file, a value."""


class StepError(UserError):
    """A recipe step failed on bad input (a layer, a shape, a value); names the step."""
