"""Write a checkpoint: safetensors + config.json + tokenizer + recipe + manifest, atomically.

Layout of ``out_dir``::

    model.safetensors                  (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
    config.json                        HF config with the matching quantization_config
    generation_config.json             if given
    tokenizer files                    if given
    recipe.yaml                        if given
    compress_manifest.json             format + version, per-layer scheme/meta, sha256 + size of every file

Everything is written into ``.<name>.tmp-XXXX`` beside ``out_dir``, fsynced, and renamed
into place; an existing export at ``out_dir`` is replaced only after the new one is
complete. An exception anywhere leaves neither a half checkpoint nor the temp dir.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from compress.io.formats import (FORMAT_NAME, FORMAT_VERSION, CheckpointFormatError,
                                 build_quantization_config, encode_quantized)
from compress.io.schemes import QuantizedWeight
from compress.errors import UserError
from compress.io.files import atomic_dir

MANIFEST_NAME = "compress_manifest.json"
RECIPE_NAME = "recipe.yaml"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "spiece.model", "sentencepiece.bpe.model")
TOKENIZER_GLOBS = ("tokenizer*.model", "*.tiktoken", "chat_template*.jinja", "additional_chat_templates/*")


class ExportError(UserError, RuntimeError):
    pass


def tool_version() -> str:
    try:
        from compress import __version__
        return __version__
    except ImportError:  # e.g. a stale editable install that maps compress as a namespace package
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("compress")
        except PackageNotFoundError:
            return "unknown"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """The single point where weight files are written (tests monkeypatch it)."""
    save_file(tensors, str(path), metadata={"format": "pt"})


def _dense_linear_modules(dense: dict[str, torch.Tensor]) -> list[str]:
    """Modules with a 2-D float ``.weight`` that are not embeddings: linears left dense."""
    out = []
    for name, t in dense.items():
        if name.endswith(".weight") and t.dim() == 2 and t.is_floating_point():
            mod = name[: -len(".weight")]
            if "embed" not in mod.rsplit(".", 1)[-1]:
                out.append(mod)
    return sorted(out)


def _shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nb
    return shards


def tokenizer_files(src: Path) -> list[Path]:
    """Every tokenizer file in model directory ``src``: the names in TOKENIZER_FILES and
    anything matching TOKENIZER_GLOBS (sentencepiece models, tiktoken files, chat templates)."""
    found = {src / name for name in TOKENIZER_FILES if (src / name).is_file()}
    for pattern in TOKENIZER_GLOBS:
        found.update(p for p in src.glob(pattern) if p.is_file())
    return sorted(found)


def _save_tokenizer(tokenizer: Any, tmp: Path) -> None:
    """``tokenizer``: a model directory whose tokenizer files are copied as they are (so a
    ``tokenizer.model`` beside ``tokenizer.json`` and the chat template survive), or an
    object with ``save_pretrained``."""
    if tokenizer is None:
        return
    if isinstance(tokenizer, (str, os.PathLike)):
        src = Path(tokenizer)
        if not src.is_dir():
            raise ExportError(f"tokenizer source {src} is not a directory")
        files = tokenizer_files(src)
        if not files:
            raise ExportError(f"no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...) in {src}")
        for f in files:
            dest = tmp / f.relative_to(src)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
        return
    tokenizer.save_pretrained(str(tmp))


def _config_dict(model_config: Any, quant_config: dict | None, dtype: torch.dtype | None) -> dict:
    cfg = json.loads(model_config.to_json_string(use_diff=False))
    cfg.pop("quantization_config", None)
    if quant_config is not None:
        cfg["quantization_config"] = quant_config
    if dtype is not None:
        cfg["dtype"] = str(dtype).replace("torch.", "")
        cfg.pop("torch_dtype", None)
    return cfg


def _check_inputs(dense: dict[str, torch.Tensor], quantized: dict[str, QuantizedWeight]) -> None:
    for name, t in dense.items():
        if not isinstance(t, torch.Tensor):
            raise ExportError(f"dense entry '{name}' is {type(t).__name__}, not a tensor")
    for mod, qw in quantized.items():
        if not isinstance(qw, QuantizedWeight):
            raise ExportError(f"quantized entry '{mod}' is {type(qw).__name__}, not a QuantizedWeight")
        if f"{mod}.weight" in dense:
            raise ExportError(f"'{mod}' is both quantized and present as dense tensor '{mod}.weight'")


def _prepare_target(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"export target {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST_NAME).is_file():
        raise ExportError(f"refusing to replace {out_dir}: it is not empty and holds no {MANIFEST_NAME} "
                          "(not a compress export)")


def export_checkpoint(out_dir: str | os.PathLike, model_config: Any,
                      state_dict_dense: dict[str, torch.Tensor],
                      quantized: dict[str, QuantizedWeight] | None = None,
                      tokenizer: Any = None, recipe_text: str | None = None,
                      extra_manifest: dict | None = None, dense_dtype: torch.dtype | None = None,
                      generation_config: Any = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write a checkpoint to ``out_dir`` atomically; returns its path.

    ``state_dict_dense``: every tensor that is not a quantized linear's weight (embeddings,
    norms, dense linears, biases of quantized linears, lm_head), cast to ``dense_dtype`` if
    given (floating tensors only). ``quantized``: module path -> QuantizedWeight. ``tokenizer``:
    an object with ``save_pretrained`` or a directory to copy tokenizer files from.
    ``generation_config``: a GenerationConfig, a dict, or None.
    """
    dtype = dense_dtype
    out_dir = Path(out_dir).absolute()
    quantized = dict(quantized or {})
    _check_inputs(state_dict_dense, quantized)
    _prepare_target(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in state_dict_dense.items():
        t = t.detach().cpu()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.contiguous()
        if t.numel() and t.data_ptr() in seen:  # tied weights: safetensors refuses shared storage
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    layers = {}
    for mod in sorted(quantized):
        qw = quantized[mod]
        try:
            enc = encode_quantized(mod, qw)
        except KeyError as e:
            raise ExportError(f"'{mod}' ({qw.scheme}) lacks tensor {e}") from None
        except CheckpointFormatError as e:
            raise ExportError(str(e)) from None
        for k, v in enc.items():
            if k in tensors:
                raise ExportError(f"tensor name clash: '{k}' is written by '{mod}' and by the dense state dict")
            tensors[k] = v.detach().cpu().contiguous()
        layers[mod] = {"scheme": qw.scheme, "meta": _jsonable(qw.meta),
                       "tensors": sorted(k[len(mod) + 1:] for k in enc)}

    quant_config = build_quantization_config(quantized, _dense_linear_modules(state_dict_dense))

    with atomic_dir(out_dir) as tmp:
        shards = _shard(tensors, max_shard_bytes)
        if len(shards) == 1:
            _write_safetensors(shards[0], tmp / SAFE_WEIGHTS_NAME)
        else:
            n = len(shards)
            weight_map, total = {}, 0
            for i, shard in enumerate(shards, 1):
                fname = f"model-{i:05d}-of-{n:05d}.safetensors"
                _write_safetensors(shard, tmp / fname)
                for k, v in shard.items():
                    weight_map[k] = fname
                    total += v.numel() * v.element_size()
            _write_json(tmp / SAFE_INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_json(tmp / "config.json", _config_dict(model_config, quant_config, dtype))
        if generation_config is not None:
            gc = generation_config if isinstance(generation_config, dict) else generation_config.to_dict()
            _write_json(tmp / "generation_config.json", gc)
        _save_tokenizer(tokenizer, tmp)
        if recipe_text is not None:
            (tmp / RECIPE_NAME).write_text(recipe_text, encoding="utf-8")

        files = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_file():
                _fsync_file(p)
                files[p.relative_to(tmp).as_posix()] = {"sha256": sha256_file(p), "size": p.stat().st_size}
        manifest = {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
            "tool": "compress", "tool_version": tool_version(),
            "dense_dtype": None if dtype is None else str(dtype).replace("torch.", ""),
            "quant_method": None if quant_config is None else quant_config["quant_method"],
            "layers": layers, "files": files, "extra": _jsonable(extra_manifest or {}),
        }
        _write_json(tmp / MANIFEST_NAME, manifest)
        _fsync_file(tmp / MANIFEST_NAME)
    return out_dir


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, torch.dtype):
        return str(obj).replace("torch.", "")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Path):
        return str(obj)
    raise ExportError(f"manifest value {obj!r} ({type(obj).__name__}) is not JSON-serializable")
