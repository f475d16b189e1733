"""The AMX-BF16 tiles of the int8-activation int4 op (w4a8_gemm*, csrc/cpu/w4a16_amx.inc):
bf16 activations against weights dequantized to bf16 per call, fp32 sums, from
set_w4a16_amx_min_rows rows on. Not the int8 tiles' bits, so they are held to the fp32
reference by SQNR (above the int8 tiles' ~45 dB) and to the int8 tiles by a tolerance;
one row and the shapes the tiles do not take keep the int8 path's bits. The float op
(w4a16_gemm*) never takes them."""
from __future__ import annotations

import contextlib

import pytest
import torch

import compress.ops as ops
from compress.ops import reference
from int_weights import make_int4
from compress.accuracy import sqnr_db

native = ops.native_available("cpu")
pytestmark = pytest.mark.skipif(not native, reason="compress._C not built")
AMX = native and ops.w4a16_amx_available() and "avx512_vnni" in ops.cpu_isas_available()
NEVER = 1 << 62


@contextlib.contextmanager
def amx_rows(rows: int):
    before = ops.set_w4a16_amx_min_rows(rows)
    try:
        yield
    finally:
        ops.set_w4a16_amx_min_rows(before)


# (M, N, K, group): a last 16-token block (M % 32 in 1..16), whole 32-token blocks, N not
# a multiple of the 32-column panels (nor of 4: row-major rows after the tiled ones);
# groups 32 (two to a 64-k chunk), 64 and 128; K of one chunk.
SHAPES = [(2, 5, 64, 32), (17, 9, 384, 128), (32, 33, 128, 64), (45, 70, 256, 32), (64, 12, 64, 64),
          (100, 37, 512, 128)]


@pytest.mark.skipif(not AMX, reason="no AMX-BF16 on this CPU (or the OS does not allow it)")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_amx_matches_reference_and_int8_tiles(shape, dtype):
    m, n, k, group = shape
    qweight, scales, zeros = make_int4(n, k, group)
    prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    x = (torch.randn(m, k) * torch.logspace(-1, 1, k)).to(dtype)  # blocks of different ranges
    ref = reference.w4a16_gemm(x.float(), qweight, scales, zeros, group)
    with ops.force_cpu_isa("avx512_vnni"):
        with amx_rows(1):
            amx = torch.ops.compress.w4a8_gemm_prepared(x, *prepared, group)
            canonical = torch.ops.compress.w4a8_gemm(x, qweight, scales, zeros, group)
            float_op = torch.ops.compress.w4a16_gemm_prepared(x, *prepared, group)
        with amx_rows(NEVER):
            int8 = torch.ops.compress.w4a8_gemm_prepared(x, *prepared, group)
    assert amx.dtype == dtype and amx.shape == (m, n)
    # bf16 keeps 8 significant bits of weights and activations: ~52 dB, the int8 tiles
    # (activations per block of 32) ~45 dB; a few outputs spread more (over 200 draws of
    # the 10-output shape, down to 41.7 dB)
    many = m * n >= 256
    assert sqnr_db(ref, amx.float()) > (48 if many else 40) - (3 if dtype == torch.bfloat16 else 0)
    assert sqnr_db(ref, amx.float()) > sqnr_db(ref, int8.float()) - 1
    torch.testing.assert_close(canonical, amx, rtol=0, atol=0)  # the same panel from either layout
    torch.testing.assert_close(amx.float(), int8.float(), rtol=0.05, atol=0.05 * ref.abs().max().item())
    # the float op keeps its fp32 numbers whatever the AMX threshold
    torch.testing.assert_close(float_op.float(), reference.w4a16_gemm(x, qweight, scales, zeros, group).float(),
                               rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=(1e-5 if dtype == torch.float32 else 1e-2) * ref.abs().max().item())


@pytest.mark.skipif(not AMX, reason="no AMX-BF16 on this CPU (or the OS does not allow it)")
@pytest.mark.parametrize("shape", [(70, 40, 256, 32), (100, 1100, 2816, 128), (40, 50, 512, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_w4a16_amx_row_bits_do_not_depend_on_the_batch(shape):
    """Up to 32 rows the tiles take one 64-k chunk of the weights at a time from an L1
    buffer, past it whole panels; both run each C tile's sums in the same order, so a
    row's outputs are the same bits in a 2-row call (padded to 16 tokens), a 16-row, a
    23-row (a partial second block) or a 32-row one and in a many-row one (N past the
    32-column panels, groups of 32, 128 and 256)."""
    m, n, k, group = shape
    qweight, scales, zeros = make_int4(n, k, group)
    prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    x = torch.randn(m, k) * torch.logspace(-1, 1, k)
    with ops.force_cpu_isa("avx512_vnni"), amx_rows(1):
        many = torch.ops.compress.w4a8_gemm_prepared(x, *prepared, group)
        for rows in (slice(0, 2), slice(3, 19), slice(5, 28), slice(8, 40), slice(m - 2, m)):
            part = torch.ops.compress.w4a8_gemm_prepared(x[rows].contiguous(), *prepared, group)
            torch.testing.assert_close(part, many[rows], rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(1, 9, 384, 128), (40, 9, 96, 32), (40, 10, 160, 32)],
                         ids=lambda s: "x".join(map(str, s)))
def test_w4a16_amx_threshold_leaves_other_calls_alone(shape):
    """One row, and K % 64 != 0 (96, 160), stay on the int8 tiles whatever the threshold."""
    m, n, k, group = shape
    qweight, scales, zeros = make_int4(n, k, group)
    prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    x = torch.randn(m, k)
    with amx_rows(1):
        low = torch.ops.compress.w4a8_gemm_prepared(x, *prepared, group)
    with amx_rows(NEVER):
        off = torch.ops.compress.w4a8_gemm_prepared(x, *prepared, group)
    torch.testing.assert_close(low, off, rtol=0, atol=0)


def test_w4a16_amx_threshold_is_checked_and_restorable():
    before = ops.set_w4a16_amx_min_rows(9)
    assert ops.set_w4a16_amx_min_rows(before) == 9
    with pytest.raises(ValueError, match="rows must be >= 1"):
        ops.set_w4a16_amx_min_rows(0)
    assert isinstance(ops.w4a16_amx_available(), bool)
