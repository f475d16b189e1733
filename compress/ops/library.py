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
    # the same product on the CPU kernel's load-time tensors (reference.w4a16_prepare_cpu)
    "w4a16_gemm_prepared": ("w4a16_gemm_prepared(Tensor x, Tensor qweight, Tensor scale, "
                            "Tensor zeros, int group_size) -> Tensor"),
    # int4 weights x int8 activations per block of 32 (reference.w4a8_gemm): the CPU fast path
    "w4a8_gemm": "w4a8_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size) -> Tensor",
    "w4a8_gemm_prepared": ("w4a8_gemm_prepared(Tensor x, Tensor qweight, Tensor scale, "
                           "Tensor zeros, int group_size) -> Tensor"),
    # the same on the weight-row-lane layout (reference.w4a8_prepare_lanes): the AVX-512 VNNI CPUs' form
    "w4a8_gemm_lanes": "w4a8_gemm_lanes(Tensor x, Tensor qweight, Tensor scale, Tensor zeros, int group_size, int n) -> Tensor",
    "w4a16_gemm_lanes": "w4a16_gemm_lanes(Tensor x, Tensor qweight, Tensor scale, Tensor zeros, int group_size, int n) -> Tensor",
    "w8a8_gemm": "w8a8_gemm(Tensor x, Tensor qweight, Tensor weight_scale) -> Tensor",
    "w8a8_outlier_gemm": ("w8a8_outlier_gemm(Tensor x, Tensor qweight, Tensor weight_scale, "
                          "Tensor outlier_idx, Tensor outlier_weight) -> Tensor"),
    # the same two on the CPU kernel's load-time row-tiled int8 weights (reference.w8a8_tile_cpu)
    "w8a8_gemm_prepared": "w8a8_gemm_prepared(Tensor x, Tensor qweight, Tensor weight_scale) -> Tensor",
    # W8A8 on the CPU op's weight-row-lane layout (reference.w8a8_prepare_lanes)
    "w8a8_gemm_lanes": "w8a8_gemm_lanes(Tensor x, Tensor qweight, Tensor scale, Tensor rowsum, int n) -> Tensor",
    # threshold: the LLM.int8 spike guard (reference.w8a8_outlier_gemm_guarded); None: static set only
    "w8a8_outlier_gemm_prepared": ("w8a8_outlier_gemm_prepared(Tensor x, Tensor qweight, Tensor weight_scale, "
                                   "Tensor outlier_idx, Tensor outlier_weight, float? threshold=None) -> Tensor"),
    "quantize_per_token_int8": "quantize_per_token_int8(Tensor x) -> (Tensor, Tensor)",
    # the runtime's hot-path helpers (a decode step is dispatch-bound without them)
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    "add_rms_norm": "add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    "decode_attention": "decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask) -> Tensor",
    # one query per row over a paged KV cache (block tables, per-row context lengths)
    "paged_decode_attention": ("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
                               "Tensor context_lens, int window) -> Tensor"),
    # the sampler's greedy pick (torch.argmax over a vocabulary row is ~10x a max reduction)
    "argmax_rows": "argmax_rows(Tensor x) -> Tensor",
    # y = x W^T of a dense (float32 / bfloat16) linear for a few rows: W read once for all of them
    "dense_gemm": "dense_gemm(Tensor x, Tensor weight) -> Tensor",
    # helper for the benchmarks: a pure streaming read (DRAM bandwidth probe)
    "stream_read_sum": "stream_read_sum(Tensor buf) -> Tensor",
}

REFERENCES = {
    "w4a16_gemm": reference.w4a16_gemm,
    "w4a16_gemm_prepared": reference.w4a16_gemm_prepared,
    "w4a8_gemm": reference.w4a8_gemm,
    "w4a8_gemm_prepared": reference.w4a8_gemm_prepared,
    "w4a8_gemm_lanes": reference.w4a8_gemm_lanes,
    "w4a16_gemm_lanes": reference.w4a16_gemm_lanes,
    "w8a8_gemm": reference.w8a8_gemm,
    "w8a8_outlier_gemm": reference.w8a8_outlier_gemm,
    "w8a8_gemm_prepared": reference.w8a8_gemm_prepared,
    "w8a8_gemm_lanes": reference.w8a8_gemm_lanes,
    "w8a8_outlier_gemm_prepared": reference.w8a8_outlier_gemm_prepared,
    "quantize_per_token_int8": reference.quantize_per_token_int8,
    "rms_norm": reference.rms_norm,
    "add_rms_norm": reference.add_rms_norm,
    "decode_attention": reference.decode_attention,
    "paged_decode_attention": reference.paged_decode_attention,
    "argmax_rows": reference.argmax_rows,
    "dense_gemm": reference.dense_gemm,
    "stream_read_sum": reference.stream_read_sum,
}


def _fake_gemm(x, qweight, *args, **kwargs):
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _fake_gemm_lanes(x, *weights_then_n):
    """The lanes ops (int4 and int8): their last argument is the number of outputs."""
    return x.new_empty((x.shape[0], weights_then_n[-1]))


def _fake_quantize_per_token_int8(x):
    return (x.new_empty(x.shape, dtype=torch.int8),
            x.new_empty((x.shape[0],), dtype=torch.float32))


def _fake_rms_norm(x, weight, eps):
    return torch.empty_like(x)


def _fake_add_rms_norm(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


def _fake_decode_attention(q, k, v, mask=None):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


def _fake_paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, window):
    return q.new_empty(q.shape)


def _fake_argmax_rows(x):
    return x.new_empty(x.shape[:-1], dtype=torch.int64)


def _fake_dense_gemm(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _fake_stream_read_sum(buf):
    return buf.new_empty((), dtype=torch.int64)


FAKES = {
    "w4a16_gemm": _fake_gemm,
    "w4a16_gemm_prepared": _fake_gemm,
    "w4a8_gemm": _fake_gemm,
    "w4a8_gemm_prepared": _fake_gemm,
    "w4a8_gemm_lanes": _fake_gemm_lanes,
    "w4a16_gemm_lanes": _fake_gemm_lanes,
    "w8a8_gemm": _fake_gemm,
    "w8a8_outlier_gemm": _fake_gemm,
    "w8a8_gemm_prepared": _fake_gemm,
    "w8a8_gemm_lanes": _fake_gemm_lanes,
    "w8a8_outlier_gemm_prepared": _fake_gemm,
    "quantize_per_token_int8": _fake_quantize_per_token_int8,
    "rms_norm": _fake_rms_norm,
    "add_rms_norm": _fake_add_rms_norm,
    "decode_attention": _fake_decode_attention,
    "paged_decode_attention": _fake_paged_decode_attention,
    "argmax_rows": _fake_argmax_rows,
    "dense_gemm": _fake_dense_gemm,
    "stream_read_sum": _fake_stream_read_sum,
}

_lib = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    _lib.define(_schema)
    _lib.impl(_name, REFERENCES[_name], "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", FAKES[_name], lib=_lib)


# --- CUDA W4A16 fragment-order layout: load-time shuffle + GEMM on it ----------------
def _fake_w4a16_shuffle_for_cuda(qweight, scales, zeros, group_size):
    np_ = reference._round_up(qweight.shape[0], reference.W4_CUDA_TILE_N)
    kp = reference._round_up(qweight.shape[1] * 8, reference.W4_CUDA_TILE_K)
    gp = -(-kp // group_size)
    return (qweight.new_empty((np_ // 16, kp * 2)), scales.new_empty((gp, np_)),
            zeros.new_empty((gp, np_), dtype=torch.uint8))


def _fake_w4a16_gemm_shuffled(x, qweight_shuffled, scales_t, zeros_t, group_size, n):
    return x.new_empty((x.shape[0], n))


_CUDA_LAYOUT_OPS = {
    "w4a16_shuffle_for_cuda": (
        "w4a16_shuffle_for_cuda(Tensor qweight, Tensor scales, Tensor zeros, int group_size) "
        "-> (Tensor, Tensor, Tensor)",
        reference.w4a16_shuffle_for_cuda, _fake_w4a16_shuffle_for_cuda),
    "w4a16_gemm_shuffled": (
        "w4a16_gemm_shuffled(Tensor x, Tensor qweight_shuffled, Tensor scales_t, Tensor zeros_t, "
        "int group_size, int n) -> Tensor",
        reference.w4a16_gemm_shuffled, _fake_w4a16_gemm_shuffled),
}
for _name, (_schema, _ref, _fake) in _CUDA_LAYOUT_OPS.items():
    _lib.define(_schema)
    _lib.impl(_name, _ref, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _fake, lib=_lib)
    SCHEMAS[_name], REFERENCES[_name], FAKES[_name] = _schema, _ref, _fake
