"""Where a stage reads its weights from: the base model's safetensors files, or an
earlier stage's export, one tensor at a time.

``ModelSource.weight(name)`` gives a float tensor by state-dict name in the model's
working dtype (the stored dtype for ``dtype: auto``); a linear quantized by an earlier
stage gives its dequantized weight, and ``quantized(module)`` its QuantizedWeight, which
a later stage carries over unless one of its steps quantizes the layer again. Nothing
is read until it is asked for.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from compress.errors import UserError
from compress.io.formats import CheckpointFormatError, decode_quantized, group_tensor_names
from compress.io.safetensors_files import SafetensorsError, TensorStore
from compress.io.schemes import QuantizedWeight
from compress.tensor_checks import all_finite, count_nonfinite

MANIFEST_NAME = "compress_manifest.json"


class SourceError(UserError):
    pass


def stored_dtype(directory: Path, store: TensorStore) -> torch.dtype:
    """The dtype the checkpoint's float weights are stored in: config.json's ``dtype`` /
    ``torch_dtype`` for a float model, else the first float tensor's."""
    try:
        cfg = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    if not cfg.get("quantization_config"):
        name = cfg.get("dtype") or cfg.get("torch_dtype")
        if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype) \
                and getattr(torch, name).is_floating_point:
            return getattr(torch, name)
    return store.first_float_dtype() or torch.float32


def check_source_quantization(directory: Path) -> None:
    """A source already quantized must be in a form this package reads back (its own
    exports: compressed-tensors int4 / int8, bitsandbytes int8, compress); an FP8 or GPTQ
    checkpoint, say, would otherwise be read as plain floats without its scales."""
    from compress.io.errors import CheckpointError
    from compress.io.quantization_config import check_quantization_config

    cfile = Path(directory) / "config.json"
    try:
        qc = json.loads(cfile.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError):
        return
    try:
        check_quantization_config(qc, cfile)
    except CheckpointError as exc:
        raise SourceError(f"{exc}: quantization_config.quant_method / format name a checkpoint that is already "
                          "quantized in a form compress cannot read back; start from the float model") from None


class ModelSource:
    def __init__(self, directory: str | Path, dtype: torch.dtype | None = None):
        """``dtype``: the working dtype float weights are rounded to (None: as stored)."""
        self.directory = Path(directory)
        check_source_quantization(self.directory)
        try:
            self.store = TensorStore(self.directory)
        except SafetensorsError as exc:
            raise SourceError(str(exc)) from None
        self.stored_dtype = stored_dtype(self.directory, self.store)
        self.dtype = dtype or self.stored_dtype
        names = {n: self.store.entry(n).dtype for n in self.store.names()}
        dense, groups = group_tensor_names(names)
        self.dense_names = set(dense)
        self.groups = groups                       # module -> (scheme, {local: full name})
        self.layer_meta: dict = {}
        manifest = self.directory / MANIFEST_NAME
        if groups and manifest.is_file():
            try:
                self.layer_meta = json.loads(manifest.read_text(encoding="utf-8")).get("layers", {})
            except ValueError as exc:
                raise SourceError(f"{manifest}: invalid JSON ({exc})") from None

    def names(self) -> list[str]:
        """State-dict names: dense tensors, and ``<module>.weight`` of quantized linears."""
        return sorted(self.dense_names | {f"{m}.weight" for m in self.groups})

    def __contains__(self, name: str) -> bool:
        return name in self.dense_names or name.removesuffix(".weight") in self.groups

    def nbytes(self) -> int:
        return self.store.nbytes

    def quantized(self, module: str) -> QuantizedWeight | None:
        if module not in self.groups:
            return None
        scheme, locs = self.groups[module]
        meta = dict(self.layer_meta.get(module, {}).get("meta", {}))
        try:
            local = {k: self.store.read(v) for k, v in locs.items()}
            return decode_quantized(module, scheme, local, meta)
        except (CheckpointFormatError, SafetensorsError) as exc:
            raise SourceError(f"{self.directory}: {exc}") from None

    def weight(self, name: str, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name``: floats rounded to the working dtype, then cast to
        ``compute_dtype`` when given; other tensors as stored."""
        module = name.removesuffix(".weight")
        if name not in self.dense_names and module in self.groups:
            t = self.quantized(module).dequantize()     # exact in fp32: not rounded to the working dtype
            return t if compute_dtype is None else t.to(compute_dtype)
        else:
            try:
                t = self.store.read(name)
            except SafetensorsError as exc:
                raise SourceError(str(exc)) from None
        if t.is_floating_point():
            if t.element_size() == 1:   # float8: a value without the scale it is stored against
                raise SourceError(f"{self.directory}: tensor {name!r} is stored as {str(t.dtype).replace('torch.', '')}"
                                  ", an FP8 checkpoint's weights, which compress does not read; start from the "
                                  "float model")
            t = t.to(self.dtype)
            if not all_finite(t):
                raise SourceError(f"{self.directory}: tensor {name!r} has {count_nonfinite(t)} NaN/Inf value(s)")
            if compute_dtype is not None:
                t = t.to(compute_dtype)
        return t
