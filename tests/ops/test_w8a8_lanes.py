"""w8a8_gemm_lanes: W8A8 on the weight-row-lane layout (reference.w8a8_prepare_lanes,
csrc/cpu/w8a8_lanes.cpp)."""
from __future__ import annotations

import pytest
import torch

import compress.ops as ops
from compress.ops import reference
from int_weights import make_int8

native = pytest.mark.skipif(not ops.native_available("cpu"), reason="native CPU kernels not built")


def _case(m, n, k, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    qweight, scale = make_int8(n, k, seed=seed)
    return torch.randn(m, k).to(dtype), qweight, scale


@pytest.mark.parametrize("n,k", [(1, 4), (15, 70), (16, 64), (33, 1024), (100, 3)])
def test_prepare_round_trips_and_pads(n, k):
    _, qweight, scale = _case(1, n, k)
    q, s, rowsum = reference.w8a8_prepare_lanes(qweight, scale)
    tiles, quads = -(-n // 16), -(-k // 4)
    assert q.shape == (tiles, quads * 64) and q.dtype == torch.int8
    assert s.shape == rowsum.shape == (tiles, 16) and s.dtype == torch.float32 and rowsum.dtype == torch.int32
    assert torch.equal(reference.w8a8_unprepare_lanes(q, n, k), qweight)
    # byte 64 j + 4 r + i of tile t is w[16 t + r, 4 j + i]
    assert torch.equal(q[0, 4:8], qweight[1, :4]) if n > 1 and k >= 4 else True
    assert torch.equal(rowsum.reshape(-1)[:n], qweight.to(torch.int32).sum(1))
    assert torch.equal(s.reshape(-1)[:n], scale.float())
    assert not s.reshape(-1)[n:].any() and not rowsum.reshape(-1)[n:].any()


def test_prepare_refuses_k_past_the_int32_sums():
    with pytest.raises(ValueError, match="K <= 65536"):
        reference.w8a8_prepare_lanes(torch.zeros(2, 65540, dtype=torch.int8), torch.ones(2))


@native
@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 12, 16, 19, 40])
@pytest.mark.parametrize("n,k", [(37, 256), (64, 512), (21, 70), (300, 1024)])
def test_lanes_op_gives_the_row_tiled_ops_bits(isa, m, n, k):
    """The lanes op's integer sums are exact and its float operations those of the row-tiled
    W8A8 kernels in their order: the same bytes as w8a8_gemm_prepared (and the reference
    within fp32 rounding), on every ISA the harness runs."""
    x, qweight, scale = _case(m, n, k, seed=m)
    prepared = reference.w8a8_prepare_lanes(qweight, scale)
    got = torch.ops.compress.w8a8_gemm_lanes(x, *prepared, n)
    assert got.shape == (m, n) and got.dtype == torch.float32
    tiled = torch.ops.compress.w8a8_gemm_prepared(x, reference.w8a8_tile_cpu(qweight), scale.float())
    assert torch.equal(got, tiled)
    torch.testing.assert_close(got, reference.w8a8_gemm(x, qweight, scale), rtol=1e-5, atol=1e-4)


@native
def test_a_row_does_not_depend_on_its_batch_or_the_threads():
    x, qweight, scale = _case(21, 70, 512)
    prepared = reference.w8a8_prepare_lanes(qweight, scale)
    batch = torch.ops.compress.w8a8_gemm_lanes(x, *prepared, 70)
    alone = torch.cat([torch.ops.compress.w8a8_gemm_lanes(x[i:i + 1], *prepared, 70) for i in range(21)])
    assert torch.equal(batch, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.compress.w8a8_gemm_lanes(x, *prepared, 70), batch)
    finally:
        torch.set_num_threads(threads)
    with ops.force_cpu_isa("scalar"):
        assert torch.equal(torch.ops.compress.w8a8_gemm_lanes(x, *prepared, 70), batch)


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_activations_come_back_in_their_dtype(dtype):
    x, qweight, scale = _case(5, 40, 256, dtype=dtype)
    got = torch.ops.compress.w8a8_gemm_lanes(x, *reference.w8a8_prepare_lanes(qweight, scale), 40)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), reference.w8a8_gemm(x.float(), qweight, scale).float(),
                               rtol=1e-2, atol=1e-2)


@native
def test_bad_arguments_name_what_is_wrong():
    x, qweight, scale = _case(2, 40, 256)
    q, s, rowsum = reference.w8a8_prepare_lanes(qweight, scale)
    op = torch.ops.compress.w8a8_gemm_lanes
    with pytest.raises(RuntimeError, match="x has K = 128"):
        op(x[:, :128], q, s, rowsum, 40)
    with pytest.raises(RuntimeError, match="n = 50 output features do not make the 3 tiles"):
        op(x, q, s, rowsum, 50)
    with pytest.raises(RuntimeError, match="rowsum must be the contiguous int32"):
        op(x, q, s, rowsum.float(), 40)
    with pytest.raises(RuntimeError, match="qweight must be the contiguous int8"):
        op(x, q.int(), s, rowsum, 40)
