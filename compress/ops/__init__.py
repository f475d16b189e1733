"""The ops layer: op schemas, references, and the native kernels when built.

``import compress.ops`` defines the ``torch.ops.compress.*`` ops (reference
implementation on every device) and then loads the native extensions that exist:
``compress._C`` (C++ CPU kernels) and ``compress._cuda`` (CUDA kernels), which
register faster implementations of the same ops on their dispatch keys.
"""
from __future__ import annotations

import importlib
import warnings

import torch

from compress.ops import library, reference  # noqa: F401  (defines the ops)

BACKENDS = ("native", "reference")
_NATIVE_MODULES = ("compress._C", "compress._cuda")
_loaded: dict[str, bool] = {}


def _load_native() -> None:
    for mod in _NATIVE_MODULES:
        try:
            importlib.import_module(mod)
            _loaded[mod] = True
        except ImportError as exc:
            _loaded[mod] = False
            if mod == "compress._C" and "No module named" not in str(exc):
                warnings.warn(f"compress: native CPU kernels failed to load ({exc}); "
                              "falling back to the PyTorch reference ops")


_load_native()


def native_available(device: str = "cpu") -> bool:
    """True when a compiled kernel library for ``device`` ('cpu' or 'cuda') is loaded."""
    return _loaded.get("compress._C" if device == "cpu" else "compress._cuda", False)


def get_op(name: str, backend: str = "native"):
    """The callable for op ``name``: the dispatcher op ('native': compiled kernel where
    one is registered for the tensors' device, reference otherwise) or the pure
    reference function ('reference')."""
    if name not in library.SCHEMAS:
        raise KeyError(f"unknown op {name!r}; ops: {sorted(library.SCHEMAS)}")
    if backend == "native":
        return getattr(torch.ops.compress, name)
    if backend == "reference":
        return library.REFERENCES[name]
    raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
