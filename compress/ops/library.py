"""torch.library definitions of the compress ops (namespace ``compress``).

Each op has one schema, the pure-PyTorch reference registered as
CompositeExplicitAutograd (runs on any device), and a fake (meta) function so
``torch.compile`` can trace it. Native kernels register on the CPU / CUDA dispatch
keys from C++ (``csrc/``) and take precedence on their device.
"""
from __future__ import annotations

import torch

from compress.ops import reference

NAMESPACE = "compress"

SCHEMAS = {
    "w4a16_gemm": "w4a16_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size) -> Tensor",
    "w8a8_gemm": "w8a8_gemm(Tensor x, Tensor qweight, Tensor weight_scale) -> Tensor",
    "w8a8_outlier_gemm": ("w8a8_outlier_gemm(Tensor x, Tensor qweight, Tensor weight_scale, "
                          "Tensor outlier_idx, Tensor outlier_weight) -> Tensor"),
    "quantize_per_token_int8": "quantize_per_token_int8(Tensor x) -> (Tensor, Tensor)",
}

REFERENCES = {
    "w4a16_gemm": reference.w4a16_gemm,
    "w8a8_gemm": reference.w8a8_gemm,
    "w8a8_outlier_gemm": reference.w8a8_outlier_gemm,
    "quantize_per_token_int8": reference.quantize_per_token_int8,
}


def _fake_gemm(x, qweight, *args, **kwargs):
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _fake_quantize_per_token_int8(x):
    return (x.new_empty(x.shape, dtype=torch.int8),
            x.new_empty((x.shape[0],), dtype=torch.float32))


FAKES = {
    "w4a16_gemm": _fake_gemm,
    "w8a8_gemm": _fake_gemm,
    "w8a8_outlier_gemm": _fake_gemm,
    "quantize_per_token_int8": _fake_quantize_per_token_int8,
}

_lib = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    _lib.define(_schema)
    _lib.impl(_name, REFERENCES[_name], "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", FAKES[_name], lib=_lib)
