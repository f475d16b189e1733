"""The exception types that mean "bad input" (shown as one clear line by the CLI,
not a traceback). Each names what is wrong and where."""
from __future__ import annotations

from compress.architectures import UnsupportedArchitectureError
from compress.calibration import CalibrationError
from compress.config import ConfigError
from compress.io.checkpoint import CheckpointError
from compress.io.export import ExportError
from compress.model_loading import ModelLoadError


class StepError(ValueError):
    """A recipe step failed on bad input (a layer, a shape, a value); names the step."""

USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, CalibrationError, ModelLoadError, UnsupportedArchitectureError, StepError,
    CheckpointError, ExportError, FileNotFoundError,
)

