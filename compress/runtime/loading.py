"""What the runtime needs from a checkpoint directory, behind one function.

``open_checkpoint(path)`` returns an object with ``config`` (HF config), ``dense``
(name -> tensor), ``quantized`` (module path -> QuantizedWeight), ``manifest`` and
``tokenizer_path``: the interface of ``compress.io.checkpoint.load_checkpoint``.
The real loader is used when it is installed; ``_load_hf_directory`` (plain HF
safetensors directories only) is the stand-in until then.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch


class CheckpointNotFoundError(FileNotFoundError):
    pass


@dataclass
class RuntimeCheckpoint:
    """Duck-type of ``compress.io.checkpoint.Checkpoint`` (what the runtime reads)."""
    config: object
    dense: dict[str, torch.Tensor]
    quantized: dict = field(default_factory=dict)
    manifest: dict | None = None
    tokenizer_path: str | None = None


def open_checkpoint(path) -> RuntimeCheckpoint:
    p = Path(path)
    if not p.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint directory at {str(path)!r}")
    if not (p / "config.json").is_file():
        raise CheckpointNotFoundError(f"{str(path)!r} has no config.json; not a model checkpoint")
    _check_model_type(p)
    try:
        from compress.io.checkpoint import load_checkpoint
    except ModuleNotFoundError as exc:
        if exc.name not in ("compress.io.checkpoint",):
            raise
        load_checkpoint = _load_hf_directory
    return load_checkpoint(p)


def _check_model_type(p: Path) -> None:
    """Refuse an unsupported architecture before any weights are read."""
    from compress.architectures import get_arch
    try:
        model_type = json.loads((p / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {p / 'config.json'}: {exc}") from exc
    get_arch(model_type, where=str(p / "config.json"))


def _load_hf_directory(p: Path) -> RuntimeCheckpoint:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFoundError(f"{str(p)!r} holds no .safetensors weights")
    dense: dict[str, torch.Tensor] = {}
    for f in files:
        dense.update(load_file(str(f)))
    tok = p if any((p / n).exists() for n in ("tokenizer.json", "tokenizer_config.json",
                                              "tokenizer.model")) else None
    return RuntimeCheckpoint(AutoConfig.from_pretrained(str(p)), dense, {}, None,
                             None if tok is None else str(tok))
