"""Load a checkpoint directory: our exports, plain HF safetensors dirs, compressed-tensors dirs.

Only safetensors are read (never pickle). Every failure is a :class:`CheckpointError`
whose message names the directory, file or tensor at fault. Loading checks everything it
can (headers, names, schemes, checksums, NaN/Inf) reading one tensor at a time; the
:class:`Checkpoint` it returns reads a tensor when one is asked for, so it holds no
weights of its own however large the files are.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open

from compress.io.errors import CheckpointError  # noqa: F401  (re-exported: callers import it from here)
from compress.io.export import MANIFEST_NAME, SAFE_INDEX_NAME, SAFE_WEIGHTS_NAME, sha256_file
from compress.io.formats import (FORMAT_NAME, SUPPORTED_FORMAT_VERSIONS, CheckpointFormatError,
                                 decode_quantized, group_tensor_names)
from compress.io.safetensors_files import SafetensorsError, SafetensorsFile, TensorStore
from compress.io.quantization_config import check_quantization_config
from compress.io.schemes import QuantizedWeight
from compress.tensor_checks import all_finite, count_nonfinite

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# config, weights and every tokenizer file (sentencepiece *.model, tiktoken, vocab/merges
# .txt, chat templates); never pickles
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja",
                      "additional_chat_templates/*", "*.yaml"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@dataclass
class Checkpoint:
    path: Path
    config: Any                                  # transformers PretrainedConfig
    manifest: dict | None
    dense: Mapping[str, torch.Tensor]           # DenseTensors: read on access
    quantized: Mapping[str, QuantizedWeight]    # QuantizedWeights: read and decoded on access
    tokenizer_path: Path | None
    files: dict[str, dict] = field(default_factory=dict)  # name -> {size, sha256?, status}
    size_bytes: int = 0                          # bytes of the safetensors weight files

    @property
    def schemes(self) -> dict[str, str]:
        if isinstance(self.quantized, QuantizedWeights):
            return self.quantized.schemes  # without reading any tensor
        return {m: q.scheme for m, q in self.quantized.items()}


# ---------------------------------------------------------------- resolving paths

def _looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "~")) and ".." not in name


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """A local directory as is; otherwise a hub id downloaded with ``snapshot_download``
    (safetensors, json and tokenizer files only)."""
    s = str(name_or_path)
    p = Path(s).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise CheckpointError(f"model path {p} is a file, not a model directory")
    if not _looks_like_hub_id(s):
        raise CheckpointError(f"model directory {p} does not exist (and {s!r} is not a Hugging Face hub id)")
    try:
        from huggingface_hub import snapshot_download
        local = snapshot_download(repo_id=s, allow_patterns=HUB_ALLOW_PATTERNS)
    except Exception as e:  # offline mode, unknown repo, network, auth ...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        hint = " (HF_HUB_OFFLINE is set, so the hub was not contacted)" if offline else ""
        raise CheckpointError(
            f"{s!r} is not a local directory ({p.absolute()} does not exist) and could not be fetched from the "
            f"Hugging Face hub{hint}: "
            f"{type(e).__name__}: {reason}") from None
    return Path(local)


# ---------------------------------------------------------------- files

def find_weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """Safetensors weight files of ``path`` (and the index's weight_map when sharded)."""
    index = path / SAFE_INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index} lists shard {f.name}, which is missing from {path}")
        return files, weight_map
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{path} holds only pickle weights ({', '.join(pickles[:3])}); compress reads safetensors only "
                "and never unpickles. Convert the model to safetensors first "
                "(e.g. load it in a trusted environment and save_pretrained(..., safe_serialization=True)).")
        raise CheckpointError(f"no *.safetensors weight files in {path}")
    return files, None


def read_manifest(path: Path) -> dict | None:
    mpath = path / MANIFEST_NAME
    if not mpath.is_file():
        return None
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except ValueError as e:
        raise CheckpointError(f"{mpath}: invalid JSON ({e})") from None
    if manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{mpath}: format {manifest.get('format')!r} is not {FORMAT_NAME!r}")
    version = manifest.get("format_version")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise CheckpointError(
            f"{mpath}: unknown format version {version!r}; this compress reads versions "
            f"{', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}")
    return manifest


def verify_files(path: Path, manifest: dict | None, strict: bool = True) -> dict[str, dict]:
    """Check every file listed in the manifest (size, sha256). ``strict`` raises on the
    first problem; otherwise each entry gets a ``status`` of ok / mismatch / missing,
    and files not in the manifest are reported as ``unlisted``."""
    out: dict[str, dict] = {}
    listed = (manifest or {}).get("files", {})
    for name, info in sorted(listed.items()):
        f = path / name
        if not f.is_file():
            if strict:
                raise CheckpointError(f"{f}: listed in {MANIFEST_NAME} but missing")
            out[name] = {"size": None, "sha256": None, "expected_sha256": info.get("sha256"), "status": "missing"}
            continue
        size = f.stat().st_size
        digest = sha256_file(f)
        ok = digest == info.get("sha256") and size == info.get("size", size)
        if strict and not ok:
            raise CheckpointError(
                f"{f}: checksum mismatch (sha256 {digest[:16]}..., size {size}; manifest says "
                f"{str(info.get('sha256'))[:16]}..., size {info.get('size')}); the file is corrupted or was modified")
        out[name] = {"size": size, "sha256": digest, "expected_sha256": info.get("sha256"),
                     "status": "ok" if ok else "mismatch"}
    if not strict:
        for f in sorted(path.rglob("*")):
            name = f.relative_to(path).as_posix()
            if f.is_file() and name not in out and name != MANIFEST_NAME:
                status = "unlisted" if manifest is not None else "unverified"
                out[name] = {"size": f.stat().st_size, "sha256": sha256_file(f), "status": status}
    return out


def read_safetensors_header(f: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype string, shape) without reading tensor data."""
    try:
        with safe_open(str(f), framework="pt") as st:
            return {k: (st.get_slice(k).get_dtype(), list(st.get_slice(k).get_shape())) for k in st.keys()}
    except Exception as e:
        raise CheckpointError(f"{f}: truncated or corrupted safetensors file ({type(e).__name__}: {e})") from None


# ---------------------------------------------------------------- config

def read_config_json(path: Path) -> dict:
    """The raw config.json of a model directory; clear errors when missing or invalid."""
    cfile = path / "config.json"
    if not cfile.is_file():
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        return json.loads(cfile.read_text(encoding="utf-8"))
    except ValueError as e:
        raise CheckpointError(f"{cfile}: invalid JSON ({e})") from None


def load_config(path: Path):
    cfile = path / "config.json"
    raw = read_config_json(path)
    check_quantization_config(raw.get("quantization_config"), cfile)
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        raise CheckpointError(f"{cfile}: transformers cannot read this config ({type(e).__name__}: {e})") from None


def _expected_tensor_names(config) -> list[tuple[str, bool]]:
    """(module or tensor, is_linear) the architecture table says must exist."""
    from compress.architectures import ARCHITECTURES
    spec = ARCHITECTURES.get(getattr(config, "model_type", None))
    if spec is None:
        return []
    out = [(f"{spec.embed_tokens}.weight", False), (f"{spec.final_norm}.weight", False)]
    for i in range(int(config.num_hidden_layers)):
        b = spec.block_prefix(i)
        out += [(f"{b}.{spec.attn_norm}.weight", False), (f"{b}.{spec.mlp_norm}.weight", False)]
        out += [(f"{b}.{lin}", True) for lin in spec.block_linears]
    if not getattr(config, "tie_word_embeddings", False):
        out.append((spec.lm_head, True))
    return out


# ---------------------------------------------------------------- tensors, read when asked for

class CheckpointFiles:
    """A checkpoint directory's safetensors files (a ``TensorStore``: headers parsed,
    tensors read on demand) that refuses to read from a file changed since it was opened
    (replaced, rewritten): a checkpoint read lazily must not mix two versions of a file."""

    def __init__(self, store: TensorStore):
        self.store, self.directory = store, store.directory
        self._stamps = {fname: _stamp(store.directory / fname) for fname in store.files}

    def names(self) -> list[str]:
        return self.store.names()

    def file_of(self, name: str) -> str:
        return self.store.location[name]

    def entry(self, name: str):
        return self.store.entry(name)

    def read(self, name: str) -> torch.Tensor:
        return self._checked(name, lambda: self.store.read(name))

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._checked(name, lambda: self.store.read_rows(name, start, stop))

    def _checked(self, name: str, read):
        path = self.directory / self.store.location[name]
        try:
            if _stamp(path) != self._stamps[path.name]:
                raise CheckpointError(f"{path} changed since the checkpoint was loaded; load it again")
            return read()
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None


def _stamp(path: Path) -> tuple[int, ...]:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class DenseTensors(Mapping):
    """A checkpoint's unquantized tensors by name. Each access reads the tensor from its
    safetensors file into a new tensor (nothing is cached), so a checkpoint holds no
    weights: whoever reads a tensor owns it and frees it by dropping it."""

    def __init__(self, files: CheckpointFiles, names):
        self._files, self._names = files, dict.fromkeys(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._files.read(name)

    def __contains__(self, name) -> bool:  # by name: Mapping's default would read the tensor
        return name in self._names

    def entry(self, name: str):
        """Tensor ``name``'s stored dtype and shape (``.dtype``, ``.shape``), read from its header."""
        if name not in self._names:
            raise KeyError(name)
        return self._files.entry(name)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name``, as stored."""
        if name not in self._names:
            raise KeyError(name)
        return self._files.read_rows(name, start, stop)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"DenseTensors({len(self)} tensors in {self._files.directory})"


class QuantizedWeights(Mapping):
    """A checkpoint's quantized linears by module path. Each access reads the module's
    tensors and decodes them into a new ``QuantizedWeight`` (nothing is cached)."""

    def __init__(self, files: CheckpointFiles, groups: dict[str, tuple[str, dict[str, str]]],
                 metas: dict[str, dict]):
        self._files, self._groups, self._metas = files, groups, metas

    @property
    def schemes(self) -> dict[str, str]:
        """module -> scheme, from the tensor names alone (nothing is read)."""
        return {mod: scheme for mod, (scheme, _) in self._groups.items()}

    def __getitem__(self, mod: str) -> QuantizedWeight:
        if mod not in self._groups:
            raise KeyError(mod)
        scheme, locs = self._groups[mod]
        return self._decode(mod, {local: self._files.read(full) for local, full in locs.items()})

    def __contains__(self, mod) -> bool:  # by name: Mapping's default would read the tensors
        return mod in self._groups

    def check(self, mod: str) -> None:
        """Decode ``mod`` as ``__getitem__`` does, reading only what the decoder checks
        values of: the packed weights themselves (the bulk of the bytes, whose dtype
        and shape the decoder checks) stand in as meta tensors of their dtype and shape."""
        scheme, locs = self._groups[mod]
        local = {}
        for name, full in locs.items():
            e = self._files.entry(full)
            local[name] = (torch.empty(e.shape, dtype=e.dtype, device="meta") if name in _PAYLOAD_NAMES
                           else self._files.read(full))
        try:
            self._decode(mod, local)
        except (NotImplementedError, RuntimeError):  # the decoder read a stand-in's values
            self[mod]

    def _decode(self, mod: str, local: dict[str, torch.Tensor]) -> QuantizedWeight:
        try:
            return decode_quantized(mod, self._groups[mod][0], local, self._metas[mod])
        except CheckpointFormatError as e:
            raise CheckpointError(f"{self._files.directory}: {e}") from None

    def __iter__(self):
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def __repr__(self) -> str:
        return f"QuantizedWeights({len(self)} modules in {self._files.directory})"


_PAYLOAD_NAMES = ("weight_packed", "weight")  # a quantized module's packed int4 / int8 weights


def _open_files(path: Path, weight_files: list[Path]) -> CheckpointFiles:
    """The directory's tensors by name (headers only). A file whose header does not fit
    it is named as truncated or corrupted; the store then checks files against the index."""
    for f in weight_files:
        try:
            SafetensorsFile(f)
        except SafetensorsError as e:
            reason = str(e).removeprefix(f"{f}: ")
            if reason.startswith("truncated or corrupted safetensors file"):   # already says it
                raise CheckpointError(f"{f}: {reason}") from None
            raise CheckpointError(f"{f}: truncated or corrupted safetensors file ({reason})") from None
    try:
        return CheckpointFiles(TensorStore(path))
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None


# ---------------------------------------------------------------- load

def load_checkpoint(path: str | os.PathLike, verify: bool = True, check_finite: bool = True) -> Checkpoint:
    """Read a checkpoint directory (see module doc). ``verify`` checks the manifest's
    sha256 of every file; ``check_finite`` rejects NaN/Inf in any floating tensor.

    Every check reads one tensor at a time; the returned checkpoint holds the files'
    headers, not their weights: ``dense`` and ``quantized`` read a tensor when it is asked
    for (``DenseTensors``, ``QuantizedWeights``), so a caller that builds something from
    them holds at most what it keeps."""
    path = resolve_model_path(path)
    manifest = read_manifest(path)
    config = load_config(path)
    files: dict[str, dict] = {}
    if manifest is not None and verify:
        files = verify_files(path, manifest, strict=True)
    weight_files, _ = find_weight_files(path)
    weights = _open_files(path, weight_files)
    entries = {name: weights.entry(name) for name in weights.names()}
    origin = weights.file_of

    dense_names, groups = group_tensor_names({k: e.dtype for k, e in entries.items()})
    layers_meta = (manifest or {}).get("layers", {})
    metas: dict[str, dict] = {}
    for mod, (scheme, locs) in groups.items():
        entry = layers_meta.get(mod)
        if entry is not None and entry.get("scheme") != scheme:
            raise CheckpointError(f"'{mod}': manifest says scheme {entry.get('scheme')!r} but its tensors "
                                  f"form {scheme!r} (in {origin(next(iter(locs.values())))})")
        meta = dict((entry or {}).get("meta", {}))
        if scheme == "llm_int8" and "threshold" not in meta:
            qc = getattr(config, "quantization_config", None) or {}
            if isinstance(qc, dict) and "llm_int8_threshold" in qc:
                meta["threshold"] = qc["llm_int8_threshold"]
        metas[mod] = meta
    quantized = QuantizedWeights(weights, groups, metas)
    for mod in groups:
        quantized.check(mod)
    for mod, entry in layers_meta.items():
        if mod not in groups:
            raise CheckpointError(f"missing tensors for '{mod}' ({entry.get('scheme')}, listed in {MANIFEST_NAME}) "
                                  f"in {path}")
        for local in entry.get("tensors", []):
            if f"{mod}.{local}" not in entries:
                raise CheckpointError(f"missing tensor '{mod}.{local}' in {path}")
    for k in dense_names:
        if k.rpartition(".")[2] in ("weight_packed", "weight_scale", "weight_zero_point", "SCB", "weight_shape"):
            raise CheckpointError(f"tensor '{k}' in {origin(k)} looks quantized but its module is not "
                                  "in a supported layout")
    dense = DenseTensors(weights, dense_names)

    for name, is_linear in _expected_tensor_names(config):
        present = (name in groups or f"{name}.weight" in dense) if is_linear else name in dense
        if not present:
            raise CheckpointError(f"missing tensor '{name if not is_linear else name + '.weight'}' in {path} "
                                  f"(required by the {config.model_type} architecture)")

    if check_finite:
        for k, e in entries.items():
            if e.dtype.is_floating_point:
                _check_finite(k, weights.read(k), origin(k))

    tok = path if any((path / m).is_file() for m in TOKENIZER_MARKERS) else None
    if not files:
        files = {f.relative_to(path).as_posix(): {"size": f.stat().st_size, "status": "unverified"}
                 for f in sorted(path.rglob("*")) if f.is_file()}
    size = sum(f.stat().st_size for f in weight_files)
    return Checkpoint(path=path, config=config, manifest=manifest, dense=dense, quantized=quantized,
                      tokenizer_path=tok, files=files, size_bytes=size)


def _check_finite(name: str, t: torch.Tensor, file_name: str | None) -> None:
    if not all_finite(t):
        where = f" in {file_name}" if file_name is not None else ""
        raise CheckpointError(f"tensor '{name}'{where} has {count_nonfinite(t)} NaN/Inf value(s)")
