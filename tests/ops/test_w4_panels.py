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
OPS = ["w4a8", "w4a16"]   # the int8-activation op, the float op


@contextlib.contextmanager
def panel_rows(op: str, rows: int):
    """The op's panel from `rows` rows (the AMX tiles off, so AMX CPUs run the panel too)."""
    setter = ops.set_w4a8_panel_min_rows if op == "w4a8" else ops.set_w4a16_panel_min_rows
    before = setter(rows)
    amx = ops.set_w4a16_amx_min_rows(NEVER)
    try:
        yield
    finally:
        setter(before)
        ops.set_w4a16_amx_min_rows(amx)


def prepared_op(op: str):
    return getattr(torch.ops.compress, f"{op}_gemm_prepared")


# (M, N, K, group): M below, at and past one 16-row m-block, odd; N not a multiple of the
# 8-row panels (a panel's last columns stored under a mask) nor of the 4-row tiling
# (row-major rows after the tiled ones); groups 32
# (two per chunk), 64, 128 and one per row (group = K); K of one chunk.
SHAPES = [(2, 5, 64, 32), (16, 12, 128, 64), (17, 13, 256, 128), (33, 70, 512, 32), (40, 25, 384, 384),
          (100, 37, 1024, 128), (7, 9, 192, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", OPS)
def test_panel_matches_reference_and_the_other_paths(op, shape, dtype):
    """Against the op's reference, its canonical entry, and the paths the panel replaces
    (the four-row int8 tiles; the float register tiles and at::mm)."""
    m, n, k, group = shape
    qweight, scales, zeros = make_int4(n, k, group)
    prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    x = (torch.randn(m, k) * torch.logspace(-1, 1, k)).to(dtype)  # blocks of different ranges
    ref = getattr(reference, f"{op}_gemm")(x, qweight, scales, zeros, group)
    with ops.force_cpu_isa("avx512_vnni"):
        with panel_rows(op, 1):
            panel = prepared_op(op)(x, *prepared, group)
            canonical = getattr(torch.ops.compress, f"{op}_gemm")(x, qweight, scales, zeros, group)
        with panel_rows(op, NEVER):
            other = prepared_op(op)(x, *prepared, group)
    assert panel.dtype == dtype and panel.shape == (m, n)
    scale = ref.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got in (panel, canonical, other):
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("op", OPS)
def test_panel_rows_do_not_depend_on_their_batch_mates_or_threads(op):
    """Each output is one thread's fixed sequence of sums over its own lane: a row gives
    the same bits alone in a 16-row block, among 40 rows, and on 1 or 2 threads."""
    qweight, scales, zeros = make_int4(30, 512, 128)
    prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    x = torch.randn(40, 512)
    threads = torch.get_num_threads()
    with ops.force_cpu_isa("avx512_vnni"), panel_rows(op, 1):
        whole = prepared_op(op)(x, *prepared, 128)
        first = prepared_op(op)(x[:3], *prepared, 128)
        tail = prepared_op(op)(x[21:], *prepared, 128)
        try:
            torch.set_num_threads(1)
            one_thread = prepared_op(op)(x, *prepared, 128)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(first, whole[:3])
    assert torch.equal(tail, whole[21:])
    assert torch.equal(one_thread, whole)


@pytest.mark.parametrize("setter,getter", [("set_w4a8_panel_min_rows", "w4a8_panel_min_rows"),
                                           ("set_w4a16_panel_min_rows", "w4a16_panel_min_rows")])
def test_panel_threshold_setters(setter, getter):
    before = getattr(ops, setter)(9)
    try:
        assert getattr(ops, getter)() == 9
    finally:
        assert getattr(ops, setter)(before) == 9
    with pytest.raises(ValueError, match="rows must be >= 1"):
        getattr(ops, setter)(0)
