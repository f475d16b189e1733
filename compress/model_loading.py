"""Loading the model to compress: a local Hugging Face directory (safetensors only) or,
when online, a hub id. Refuses unsupported architectures and non-finite weights."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from compress.architectures import ArchSpec, get_arch
from compress.dtypes import DTYPES
from compress.io.checkpoint import resolve_model_path
from compress.errors import UserError

class ModelLoadError(UserError):
    pass


def read_arch(model_dir: Path) -> ArchSpec:
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{model_dir}: no config.json; is this a Hugging Face model directory?")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg_path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    return get_arch(cfg.get("model_type", "<missing model_type>"), where=str(cfg_path))


def load_model_for_compression(name_or_path: str, dtype: str = "float32", trust_remote_code: bool = False):
    """Returns (model, tokenizer, arch, model_dir). The model is in eval mode on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_path(name_or_path)
    arch = read_arch(model_dir)
    if not any(model_dir.glob("*.safetensors")):
        raise ModelLoadError(f"{model_dir}: no .safetensors weights (compress never unpickles .bin files; "
                             "convert them to safetensors first)")
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], use_safetensors=True,
                                                     trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"{model_dir}: could not load the weights: {type(exc).__name__}: {exc}") from None
    model.eval()
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise ModelLoadError(f"{model_dir}: tensor {name!r} contains NaN/Inf")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    return model, tokenizer, arch, model_dir
