"""The panel GEMMs of the int4 ops, from their row thresholds on at the avx512_vnni level:
the int8-activation op's (w4a8_gemm*, csrc/cpu/w4a8_panel.inc: 16 activation rows per
vpdpbusd, weight panels unpacked per call; its integer dots are the reference's, the fp32
sums run per block, then per group) and the float op's (w4a16_gemm*,
csrc/cpu/w4a16_panel.inc: 16 rows per FMA on the reference's fp32 weights, each output
summed in K order)."""
from __future__ import annotations

import contextlib

import pytest
import torch

import compress.ops as ops
from compress.ops import reference
from int_weights import make_int4

native = ops.native_available("cpu")
VNNI = native and "avx512_vnni" in ops.cpu_isas_available()
pytestmark = pytest.mark.skipif(not VNNI, reason="compress._C not built or no AVX-512 VNNI on this CPU")
NEVER = 1 << 62


@contextlib.contextmanager
def panel_rows(rows: int):
    before = ops.set_w4a8_panel_min_rows(rows)
    amx = ops.set_w4a16_amx_min_rows(NEVER)  # the panel, not the AMX tiles, on AMX CPUs too
    try:
        yield
    finally:
        ops.set_w4a8_panel_min_rows(before)
        ops.set_w4a16_amx_min_rows(amx)


# (M, N, K, group): M below, at and past one 16-row m-block, odd; N not a multiple of the
# 12-row panels nor of the 4-row tiling (row-major rows after the tiled ones); groups 32
# (two per chunk), 64, 128 and one per row (group = K); K of one chunk.
SHAPES = [(2, 5, 64, 32), (16, 12, 128, 64), (17, 13, 256, 128), (33, 70, 512, 32), (40, 25, 384, 384),
          (100, 37, 1024, 128), (7, 9, 192, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_matches_reference_and_tiles(shape, dtype):
    m, n, k, group = shape
    qweight, scales, zeros = make_int4(n, k, group)
    prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    x = (torch.randn(m, k) * torch.logspace(-1, 1, k)).to(dtype)  # blocks of different ranges
    ref = reference.w4a8_gemm(x, qweight, scales, zeros, group)
    with ops.force_cpu_isa("avx512_vnni"):
        with panel_rows(1):
            panel = torch.ops.compress.w4a8_gemm_prepared(x, *prepared, group)
            canonical = torch.ops.compress.w4a8_gemm(x, qweight, scales, zeros, group)
        with panel_rows(NEVER):
            tiles = torch.ops.compress.w4a8_gemm_prepared(x, *prepared, group)
    assert panel.dtype == dtype and panel.shape == (m, n)
    scale = ref.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(panel.float(), ref.float(), rtol=tol, atol=tol * scale)
    torch.testing.assert_close(canonical.float(), panel.float(), rtol=tol, atol=tol * scale)
    torch.testing.assert_close(panel.float(), tiles.float(), rtol=tol, atol=tol * scale)


def test_panel_rows_do_not_depend_on_their_batch_mates_or_threads():
    """Each output is one thread's fixed sequence of sums over its own lane: a row gives
    the same bits alone in a 16-row block, among 40 rows, and on 1 or 2 threads."""
    qweight, scales, zeros = make_int4(30, 512, 128)
    prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    x = torch.randn(40, 512)
    threads = torch.get_num_threads()
    with ops.force_cpu_isa("avx512_vnni"), panel_rows(1):
        whole = torch.ops.compress.w4a8_gemm_prepared(x, *prepared, 128)
        first = torch.ops.compress.w4a8_gemm_prepared(x[:3], *prepared, 128)
        tail = torch.ops.compress.w4a8_gemm_prepared(x[21:], *prepared, 128)
        try:
            torch.set_num_threads(1)
            one_thread = torch.ops.compress.w4a8_gemm_prepared(x, *prepared, 128)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(first, whole[:3])
    assert torch.equal(tail, whole[21:])
    assert torch.equal(one_thread, whole)


def test_panel_threshold_setter():
    before = ops.set_w4a8_panel_min_rows(9)
    try:
        assert ops.w4a8_panel_min_rows() == 9
    finally:
        assert ops.set_w4a8_panel_min_rows(before) == 9
    with pytest.raises(ValueError, match="rows must be >= 1"):
        ops.set_w4a8_panel_min_rows(0)


# ---------------------------------------------------------------- the float op's panel
@contextlib.contextmanager
def float_panel_rows(rows: int):
    before = ops.set_w4a16_panel_min_rows(rows)
    try:
        yield
    finally:
        ops.set_w4a16_panel_min_rows(before)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_panel_matches_reference_and_the_other_paths(shape, dtype):
    """w4a16_gemm*'s AVX-512 panel GEMM: the reference's fp32 weights, sums in another
    order; against the reference, the canonical entry, and the paths it replaces."""
    m, n, k, group = shape
    qweight, scales, zeros = make_int4(n, k, group)
    prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    x = (torch.randn(m, k) * torch.logspace(-1, 1, k)).to(dtype)
    ref = reference.w4a16_gemm(x.float(), qweight, scales, zeros, group).to(dtype)
    with ops.force_cpu_isa("avx512_vnni"):
        with float_panel_rows(1):
            panel = torch.ops.compress.w4a16_gemm_prepared(x, *prepared, group)
            canonical = torch.ops.compress.w4a16_gemm(x, qweight, scales, zeros, group)
        with float_panel_rows(NEVER):
            other = torch.ops.compress.w4a16_gemm_prepared(x, *prepared, group)
    assert panel.dtype == dtype and panel.shape == (m, n)
    scale = ref.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got in (panel, canonical, other):
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * scale)


def test_float_panel_rows_do_not_depend_on_their_batch_mates_or_threads():
    qweight, scales, zeros = make_int4(30, 512, 128)
    prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    x = torch.randn(40, 512)
    threads = torch.get_num_threads()
    with ops.force_cpu_isa("avx512_vnni"), float_panel_rows(1):
        whole = torch.ops.compress.w4a16_gemm_prepared(x, *prepared, 128)
        tail = torch.ops.compress.w4a16_gemm_prepared(x[21:], *prepared, 128)
        try:
            torch.set_num_threads(1)
            one_thread = torch.ops.compress.w4a16_gemm_prepared(x, *prepared, 128)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(tail, whole[21:])
    assert torch.equal(one_thread, whole)
