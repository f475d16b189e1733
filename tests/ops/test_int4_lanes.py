"""w4a8_gemm_lanes / w4a16_gemm_lanes: int4 GEMMs (int8 / float activations) on the weight-row-lane layout
(reference.w4a8_prepare_lanes, csrc/cpu/w4a8_lanes.cpp)."""
from __future__ import annotations

import pytest
import torch

import compress.ops as ops
from compress.accuracy import sqnr_db
from compress.ops import reference
from int_weights import make_int4, make_int8
from held_thread import run_with_a_held_thread

native = pytest.mark.skipif(not ops.native_available("cpu"), reason="native CPU kernels not built")


def _case(m, n, k, group, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    qweight, scales, zeros = make_int4(n, k, group)
    return torch.randn(m, k).to(dtype), qweight, scales, zeros


@pytest.mark.parametrize("n,k", [(1, 64), (15, 128), (16, 64), (17, 192), (33, 512), (100, 1024)])
def test_prepare_round_trips_and_pads_rows(n, k):
    _, qweight, scales, zeros = _case(1, n, k, 64)
    q, scale, z = reference.w4a8_prepare_lanes(qweight, scales, zeros)
    tiles = -(-n // 16)
    assert q.shape == (tiles, 2 * k) and q.dtype == torch.int32
    assert scale.shape == z.shape == (tiles, k // 64, 16) and scale.dtype == torch.float32 and z.dtype == torch.uint8
    assert torch.equal(reference.w4a8_unprepare_lanes(q, n), qweight)
    # word j of row r's chunk c sits at int32 ((c * 8 + j) * 16 + r) of its tile; padded rows are zero
    words = q.reshape(tiles, k // 64, 8, 16)
    assert torch.equal(words[0, 0, :, 0], qweight[0, :8])
    if n % 16:
        assert not words[-1, :, :, n % 16:].any()
    assert torch.equal(reference.lanes_metadata_rows(scale, n), scales.float())
    assert torch.equal(reference.lanes_metadata_rows(z, n), zeros)
    assert torch.equal(scale[0, :, 0], scales[0].float())
    if n % 16:
        assert not scale[-1, :, n % 16:].any() and not z[-1, :, n % 16:].any()


def test_prepare_refuses_k_off_the_chunk():
    _, qweight, scales, zeros = _case(1, 8, 96, 32)
    with pytest.raises(ValueError, match="divisible by 64"):
        reference.w4a8_prepare_lanes(qweight, scales, zeros)


@native
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 16, 20, 33])
@pytest.mark.parametrize("n,k,group", [(37, 256, 32), (64, 512, 128), (21, 384, 64), (300, 1024, 128)])
def test_lanes_op_matches_the_reference(isa, m, n, k, group):
    """The native op (AVX-512 VNNI, the AVX2 half tiles, scalar) against the reference of
    the same form and against w4a8_gemm on the canonical tensors: the same integer dots,
    fp32 sums in another order."""
    x, qweight, scales, zeros = _case(m, n, k, group, seed=m)
    prepared = reference.w4a8_prepare_lanes(qweight, scales, zeros)
    got = torch.ops.compress.w4a8_gemm_lanes(x, *prepared, group, qweight.shape[0])
    assert got.shape == (m, n) and got.dtype == torch.float32
    ref = reference.w4a8_gemm_lanes(x, *prepared, group, n)
    assert sqnr_db(ref, got) > 100
    assert sqnr_db(reference.w4a8_gemm(x, qweight, scales, zeros, group), got) > 100


@native
def test_rows_past_one_pass_over_the_weights():
    """More rows than one pass keeps in L2 (256 KiB of activations: 128 rows at K = 2048)
    run in passes; each row's result is the one it gets alone."""
    x, qweight, scales, zeros = _case(200, 40, 2048, 128)
    prepared = reference.w4a8_prepare_lanes(qweight, scales, zeros)
    got = torch.ops.compress.w4a8_gemm_lanes(x, *prepared, 128, qweight.shape[0])
    assert sqnr_db(reference.w4a8_gemm(x, qweight, scales, zeros, 128), got) > 100
    for i in (0, 127, 128, 199):
        assert torch.equal(torch.ops.compress.w4a8_gemm_lanes(x[i:i + 1], *prepared, 128, qweight.shape[0]), got[i:i + 1])


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_activations_come_back_in_their_dtype(dtype):
    x, qweight, scales, zeros = _case(5, 40, 256, 64, dtype=dtype)
    prepared = reference.w4a8_prepare_lanes(qweight, scales, zeros)
    got = torch.ops.compress.w4a8_gemm_lanes(x, *prepared, 64, qweight.shape[0])
    assert got.dtype == dtype
    want = reference.w4a8_gemm(x.float(), qweight, scales, zeros, 64)
    assert sqnr_db(want, got.float()) > 40


@native
@pytest.mark.parametrize("op,m,n,group", [("w4a8", 11, 45, 32), ("w4a8", 19, 70, 128), ("w4a16", 11, 45, 64)])
def test_a_row_does_not_depend_on_its_batch_the_threads_or_the_isa(op, m, n, group):
    """Rows are computed independently in a fixed order (the float op keeps four partial
    sums a row and group): a row's bytes are the same alone or in a batch (full tiles and
    their remainders), on one thread or two, and on the scalar form below AVX-512 VNNI."""
    gemm = getattr(torch.ops.compress, f"{op}_gemm_lanes")
    x, qweight, scales, zeros = _case(m, n, 512, group)
    prepared = reference.w4a8_prepare_lanes(qweight, scales, zeros)
    batch = gemm(x, *prepared, group, n)
    alone = torch.cat([gemm(x[i:i + 1], *prepared, group, n) for i in range(m)])
    assert torch.equal(batch, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemm(x, *prepared, group, n), batch)
    finally:
        torch.set_num_threads(threads)
    for isa in ("avx2", "scalar"):
        with ops.force_cpu_isa(isa):
            assert torch.equal(gemm(x, *prepared, group, n), batch)


@native
@pytest.mark.parametrize("n", [45, 64, 70])
def test_tile_pairs_move_no_bit(n):
    """From w4a8_lanes_pair_min_rows rows the AVX-512 VNNI form runs two weight tiles a call
    (4 rows at a time; an odd last tile alone): every output gets the same operations, so
    the bytes equal one tile a call, at every row count and with a partial last tile."""
    from compress import _C
    x, qweight, scales, zeros = _case(19, n, 512, 128)
    prepared = reference.w4a8_prepare_lanes(qweight, scales, zeros)
    before = _C.set_w4a8_lanes_pair_min_rows(1)
    try:
        for m in (1, 2, 3, 5, 8, 16, 19):
            _C.set_w4a8_lanes_pair_min_rows(1)
            pairs = torch.ops.compress.w4a8_gemm_lanes(x[:m], *prepared, 128, n)
            _C.set_w4a8_lanes_pair_min_rows(1 << 40)
            single = torch.ops.compress.w4a8_gemm_lanes(x[:m], *prepared, 128, n)
            assert torch.equal(pairs, single), m
    finally:
        _C.set_w4a8_lanes_pair_min_rows(before)
    with pytest.raises(ValueError, match="rows must be >= 1"):
        _C.set_w4a8_lanes_pair_min_rows(0)


amx = pytest.mark.skipif(not (ops.native_available("cpu") and ops.cpu_isa() == "avx512_vnni"
                               and ops.w8a8_amx_available()), reason="needs AMX-INT8 (and the OS's permission)")


@amx
@pytest.mark.parametrize("n,k,group", [(37, 256, 32), (64, 512, 128), (21, 384, 64), (45, 512, 256), (300, 1024, 128)])
def test_amx_tiles_give_the_bits_of_the_avx512_tiles(n, k, group):
    """From w4a8_lanes_amx_min_rows rows, on CPUs with AMX-INT8, the op takes tdpbsud tiles
    (csrc/cpu/w4a8_lanes_amx.inc): the same exact int32 dots a block of 32 and the same
    float steps after them, so the same bytes as the AVX-512 tiles, for row counts off the
    16-row tiles, partial last weight tiles, groups of one block, and rows alone."""
    x, qweight, scales, zeros = _case(70, n, k, group, seed=n)
    prepared = reference.w4a8_prepare_lanes(qweight, scales, zeros)
    gemm = torch.ops.compress.w4a8_gemm_lanes
    before = ops.set_w4a8_lanes_amx_min_rows(2)
    try:
        for m in (2, 7, 16, 17, 33, 70):
            ops.set_w4a8_lanes_amx_min_rows(2)
            tiles = gemm(x[:m], *prepared, group, n)
            ops.set_w4a8_lanes_amx_min_rows(1 << 40)
            assert torch.equal(tiles, gemm(x[:m], *prepared, group, n)), m
        ops.set_w4a8_lanes_amx_min_rows(2)
        assert torch.equal(gemm(x[5:6], *prepared, group, n), tiles[5:6])   # one row: the AVX-512 tiles
    finally:
        ops.set_w4a8_lanes_amx_min_rows(before)


@native
def test_amx_rows_threshold_refuses_zero():
    with pytest.raises(ValueError, match="rows must be >= 1"):
        ops.set_w4a8_lanes_amx_min_rows(0)


@native
def test_bad_arguments_name_what_is_wrong():
    x, qweight, scales, zeros = _case(2, 20, 256, 64)
    q, scale, z = reference.w4a8_prepare_lanes(qweight, scales, zeros)
    op = torch.ops.compress.w4a8_gemm_lanes
    with pytest.raises(RuntimeError, match="qweight holds K = 256 a row, x has K = 192"):
        op(x[:, :192], q, scale, z, 64, 20)
    with pytest.raises(RuntimeError, match="group_size must divide K and be 32 or a multiple of 64"):
        op(x, q, scale, z, 96, 20)
    with pytest.raises(RuntimeError, match=r"scale must be the contiguous float32 \[tiles, K / group_size, 16\]"):
        op(x, q, scale.reshape(-1, 16).contiguous(), z, 64, 20)
    with pytest.raises(RuntimeError, match="zeros must be contiguous uint8 shaped like scale"):
        op(x, q, scale, z[:, :2].contiguous(), 64, 20)
    with pytest.raises(RuntimeError, match="zeros must be contiguous uint8"):
        op(x, q, scale, z.float(), 64, 20)
    with pytest.raises(RuntimeError, match="n = 40 output features do not make the 2 tiles"):
        op(x, q, scale, z, 64, 40)


# --- float activations (w4a16_gemm_lanes, csrc/cpu/w4a16_lanes.cpp) on the same layout ---

@native
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("n,k,group", [(37, 256, 32), (64, 512, 128), (21, 384, 8), (300, 1024, 128)])
def test_float_lanes_op_matches_the_reference(isa, m, n, k, group):
    """On every ISA level (AVX-512, the AVX2 half tiles, scalar)."""
    x, qweight, scales, zeros = _case(m, n, k, group, seed=m)
    prepared = reference.w4a8_prepare_lanes(qweight, scales, zeros)
    got = torch.ops.compress.w4a16_gemm_lanes(x, *prepared, group, qweight.shape[0])
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert sqnr_db(reference.w4a16_gemm(x, qweight, scales, zeros, group), got) > 100
    assert torch.equal(reference.w4a16_gemm_lanes(x, *prepared, group, n), reference.w4a16_gemm(x, qweight, scales, zeros, group))


@native
def test_float_lanes_half_activations_and_bad_groups():
    x, qweight, scales, zeros = _case(3, 40, 256, 64, dtype=torch.bfloat16)
    prepared = reference.w4a8_prepare_lanes(qweight, scales, zeros)
    got = torch.ops.compress.w4a16_gemm_lanes(x, *prepared, 64, qweight.shape[0])
    assert got.dtype == torch.bfloat16
    assert sqnr_db(reference.w4a16_gemm(x.float(), qweight, scales, zeros, 64), got.float()) > 40
    with pytest.raises(RuntimeError, match="group_size must be a multiple of 8 dividing K"):
        torch.ops.compress.w4a16_gemm_lanes(x.float(), prepared[0], prepared[1], prepared[2], 12, 40)


@native
@pytest.mark.parametrize("op,m,n", [("w4a8", 1, 1000), ("w4a8", 16, 333), ("w4a16", 5, 1000), ("w8a8", 3, 1000)])
def test_a_thread_held_up_has_its_tiles_taken_over_without_moving_a_bit(op, m, n):
    """The lanes ops split the weight tiles in one run per thread; a thread done with its
    own takes the rest of another's from its end (kernel_common.h: parallel_parts_stealing).
    With the first thread held 3 ms at every call, the second takes tiles over (counted by
    lanes_tiles_stolen) and every output keeps the bits of the static split."""
    from compress import _C
    torch.manual_seed(m)
    x = torch.randn(m, 512)
    if op == "w8a8":
        prepared = reference.w8a8_prepare_lanes(*make_int8(n, 512, seed=m))

        def gemm():
            return torch.ops.compress.w8a8_gemm_lanes(x, *prepared, n)
    else:
        _, qweight, scales, zeros = _case(m, n, 512, 128)
        prepared = reference.w4a8_prepare_lanes(qweight, scales, zeros)

        def gemm():
            return getattr(torch.ops.compress, f"{op}_gemm_lanes")(x, *prepared, 128, n)
    static, held, stolen = run_with_a_held_thread(gemm, _C.set_lanes_tile_stealing)
    assert stolen > 0
    assert torch.equal(held, static)
    with pytest.raises(ValueError, match="microseconds"):
        _C.set_lanes_test_hold_us(-1)
