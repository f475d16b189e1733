"""Write a checkpoint: safetensors + config.json + tokenizer + recipe + manifest, atomically.

Layout of ``out_dir``::

    model.safetensors                  (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
    config.json                        HF config with the matching quantization_config
    generation_config.json             if given
    tokenizer files                    if given
    recipe.yaml                        if given
    compress_manifest.json             format + version, per-layer scheme/meta, sha256 + size of every file

Tensors are streamed into the shards as they are produced (``CheckpointWriter``;
``compress/io/safetensors_files.py``), so an export never holds the model's tensors
twice. Everything is written into ``.<name>.tmp-XXXX`` beside ``out_dir``, fsynced, and renamed
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

from compress.io.formats import (FORMAT_NAME, FORMAT_VERSION, CheckpointFormatError,
                                 build_quantization_config, encode_quantized)
from compress.io.schemes import QuantizedWeight
from compress.errors import UserError
from compress.io.files import atomic_dir, fsync_file
from compress.io.safetensors_files import SAFE_INDEX_NAME, SAFE_WEIGHTS_NAME, ShardedWriter

MANIFEST_NAME = "compress_manifest.json"
RECIPE_NAME = "recipe.yaml"
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


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_tensor(writer: ShardedWriter, name: str, t: torch.Tensor) -> None:
    """The single point where weight data is written (tests monkeypatch it)."""
    writer.add(name, t)


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


class CheckpointWriter:
    """An export written as it is produced: ``add_dense`` / ``add_quantized`` stream each
    tensor into the shards of a temporary directory beside ``out_dir``; ``finish`` writes
    config, tokenizer, recipe and manifest, and the directory replaces ``out_dir`` when
    the ``with`` block ends without an error (on an error nothing is left)::

        with CheckpointWriter(out_dir, dense_dtype=torch.bfloat16) as w:
            w.add_dense("model.norm.weight", t)
            w.add_quantized("model.layers.0.mlp.up_proj", qw)
            w.finish(model_config, tokenizer=src_dir)
    """

    def __init__(self, out_dir: str | os.PathLike, dense_dtype: torch.dtype | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.out_dir = Path(out_dir).absolute()
        self.dtype, self.max_shard_bytes = dense_dtype, max_shard_bytes
        self.layers: dict[str, dict] = {}
        self.quantized: dict[str, QuantizedWeight] = {}     # tensors dropped: scheme + meta + zeros only
        self.dense_linears: list[str] = []
        self.finished = False

    def __enter__(self) -> "CheckpointWriter":
        _prepare_target(self.out_dir)
        self._atomic = atomic_dir(self.out_dir)
        self.tmp = self._atomic.__enter__()
        self.writer = ShardedWriter(self.tmp, self.max_shard_bytes)
        return self

    def __exit__(self, exc_type, exc, tb):
        self.writer.abort()
        if exc_type is None and not self.finished:
            exc_type = ExportError
            exc = ExportError(f"{self.out_dir}: export ended before finish()")
        if exc_type is not None:
            self._atomic.__exit__(exc_type, exc, tb)
            return False
        return self._atomic.__exit__(None, None, None)

    def _write(self, name: str, t: torch.Tensor) -> None:
        if name in self.writer.names:
            raise ExportError(f"tensor name clash: '{name}' is written twice")
        _write_tensor(self.writer, name, t)

    def add_dense(self, name: str, t: torch.Tensor) -> None:
        """A tensor that is not a quantized linear's weight (embeddings, norms, dense
        linears, biases, lm_head), cast to the dense dtype when it is a float."""
        if not isinstance(t, torch.Tensor):
            raise ExportError(f"dense entry '{name}' is {type(t).__name__}, not a tensor")
        mod = name.removesuffix(".weight")
        if mod in self.quantized:
            raise ExportError(f"'{mod}' is both quantized and present as dense tensor '{name}'")
        if self.dtype is not None and t.is_floating_point():
            t = t.to(self.dtype)
        self._write(name, t)
        if _is_dense_linear(name, t):
            self.dense_linears.append(mod)

    def add_quantized(self, module: str, qw: QuantizedWeight) -> None:
        if not isinstance(qw, QuantizedWeight):
            raise ExportError(f"quantized entry '{module}' is {type(qw).__name__}, not a QuantizedWeight")
        if f"{module}.weight" in self.writer.names:
            raise ExportError(f"'{module}' is both quantized and present as dense tensor '{module}.weight'")
        try:
            enc = encode_quantized(module, qw)
        except KeyError as e:
            raise ExportError(f"'{module}' ({qw.scheme}) lacks tensor {e}") from None
        except CheckpointFormatError as e:
            raise ExportError(str(e)) from None
        for k, v in enc.items():
            if k in self.writer.names:
                raise ExportError(f"tensor name clash: '{k}' is written by '{module}' and by the dense state dict")
            self._write(k, v)
        self.layers[module] = {"scheme": qw.scheme, "meta": _jsonable(qw.meta),
                               "tensors": sorted(k[len(module) + 1:] for k in enc)}
        # what the quantization_config needs of a layer (its scheme, meta, int4 zero points)
        self.quantized[module] = QuantizedWeight(
            qw.scheme, {"zeros": qw.tensors["zeros"]} if "zeros" in qw.tensors else {}, dict(qw.meta))

    def finish(self, model_config: Any, tokenizer: Any = None, recipe_text: str | None = None,
               extra_manifest: dict | None = None, generation_config: Any = None) -> None:
        tmp, dtype = self.tmp, self.dtype
        self.writer.finish()
        quant_config = build_quantization_config(self.quantized, sorted(self.dense_linears))
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
                fsync_file(p)
                files[p.relative_to(tmp).as_posix()] = {"sha256": sha256_file(p), "size": p.stat().st_size}
        manifest = {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
            "tool": "compress", "tool_version": tool_version(),
            "dense_dtype": None if dtype is None else str(dtype).replace("torch.", ""),
            "quant_method": None if quant_config is None else quant_config["quant_method"],
            "layers": dict(sorted(self.layers.items())), "files": files, "extra": _jsonable(extra_manifest or {}),
        }
        _write_json(tmp / MANIFEST_NAME, manifest)
        fsync_file(tmp / MANIFEST_NAME)
        self.finished = True


def _is_dense_linear(name: str, t: torch.Tensor) -> bool:
    """A 2-D float ``.weight`` that is not an embedding: a linear left dense."""
    return (name.endswith(".weight") and t.dim() == 2 and t.is_floating_point()
            and "embed" not in name[: -len(".weight")].rsplit(".", 1)[-1])


def export_checkpoint(out_dir: str | os.PathLike, model_config: Any,
                      state_dict_dense: dict[str, torch.Tensor],
                      quantized: dict[str, QuantizedWeight] | None = None,
                      tokenizer: Any = None, recipe_text: str | None = None,
                      extra_manifest: dict | None = None, dense_dtype: torch.dtype | None = None,
                      generation_config: Any = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write a checkpoint held in memory to ``out_dir`` atomically; returns its path.

    ``state_dict_dense``: every tensor that is not a quantized linear's weight (embeddings,
    norms, dense linears, biases of quantized linears, lm_head), cast to ``dense_dtype`` if
    given (floating tensors only). ``quantized``: module path -> QuantizedWeight. ``tokenizer``:
    an object with ``save_pretrained`` or a directory to copy tokenizer files from.
    ``generation_config``: a GenerationConfig, a dict, or None.
    """
    quantized = dict(quantized or {})
    _check_inputs(state_dict_dense, quantized)
    with CheckpointWriter(out_dir, dense_dtype, max_shard_bytes) as w:
        for name in sorted(state_dict_dense):
            w.add_dense(name, state_dict_dense[name])
        for mod in sorted(quantized):
            w.add_quantized(mod, quantized[mod])
        w.finish(model_config, tokenizer, recipe_text, extra_manifest, generation_config)
    return w.out_dir


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
