"""The error of an unreadable checkpoint (its own module: the checkpoint reader and the
quantization-config check both raise it)."""
from __future__ import annotations

from compress.errors import UserError


class CheckpointError(UserError):
    """A checkpoint cannot be read; the message names what and where."""
