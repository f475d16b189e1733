"""What the runtime needs from a checkpoint, behind one function.

``open_checkpoint(path)`` returns ``compress.io.checkpoint.Checkpoint``: ``config``
(HF config), ``dense`` (name -> tensor), ``quantized`` (module path ->
QuantizedWeight), ``manifest``, ``tokenizer_path``. The architecture is checked
against ``compress.architectures`` before any weights are read.
``RuntimeCheckpoint`` is the same interface for checkpoints built in memory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compress.architectures import get_arch
from compress.io.checkpoint import CheckpointError, load_checkpoint, resolve_model_path


@dataclass
class RuntimeCheckpoint:
    """An in-memory checkpoint (what ``LLM.from_checkpoint`` reads)."""
    config: object
    dense: dict[str, torch.Tensor]
    quantized: dict = field(default_factory=dict)
    manifest: dict | None = None
    tokenizer_path: str | None = None
    path: Path | None = None


def open_checkpoint(path, verify: bool = True):
    """Load a checkpoint directory (compress export, compressed-tensors or plain HF
    safetensors; a hub id when online). Errors name the path and what is wrong."""
    directory = resolve_model_path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{directory}: no config.json (not a Hugging Face model directory)")
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except ValueError as exc:
        raise CheckpointError(f"{config_file}: invalid JSON ({exc})") from None
    get_arch(model_type, where=str(config_file))
    return load_checkpoint(directory, verify=verify)
