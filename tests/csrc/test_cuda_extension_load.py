"""compress.ops loading compress._cuda: an extension that was never built leaves the
reference ops in place quietly; one that is built but does not load, on a machine with a
GPU, stops the import (otherwise every CUDA op would run the reference and the GPU suite
would skip and pass)."""
from __future__ import annotations

import pytest
import torch

import compress.ops as ops


def _importer(cuda_error: ImportError | None):
    def import_module(name):
        if name == "compress._cuda" and cuda_error is not None:
            raise cuda_error
    return import_module


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(ops, "_loaded", {})


def _not_found(name):
    return ModuleNotFoundError(f"No module named {name!r}", name=name)


def test_a_broken_cuda_extension_stops_the_import_where_a_gpu_is(monkeypatch, fresh_state):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for exc in (ImportError("compress/_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEa"),
                _not_found("libcudart")):  # a dependency of the extension is missing
        with pytest.raises(ops.CudaKernelsLoadError, match="built but does not load") as info:
            ops._load_native(_importer(exc))
        assert str(exc) in str(info.value)


def test_an_unbuilt_cuda_extension_leaves_the_reference_ops(monkeypatch, fresh_state):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ops._load_native(_importer(_not_found("compress._cuda")))
    assert not ops.native_available("cuda")


def test_a_broken_cuda_extension_is_ignored_without_a_gpu(monkeypatch, fresh_state):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ops._load_native(_importer(ImportError("undefined symbol: x")))
    assert not ops.native_available("cuda")


def test_a_loaded_cuda_extension_is_reported(monkeypatch, fresh_state):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ops._load_native(_importer(None))
    assert ops.native_available("cuda")
