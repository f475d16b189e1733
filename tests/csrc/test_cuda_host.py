"""Host tests of the CUDA kernels' __host__ __device__ helpers (no GPU needed).

csrc/cuda/tests/host_harness.cu is compiled by nvcc into a shared library (cached
under build/cuda_host/<source hash>/ by native_harness.py) and driven through ctypes. Everything is checked
against compress/ops/reference.py or, for the mma.sync / ldmatrix fragment layouts, the
PTX ISA tables: the fragment helpers, the int4 shuffle, the lop3 magic-number
dequantization (exhaustive over nibbles x zero points, fp16 and bf16), the per-token
int8 quantization math and the quantize kernel's outlier pass, the W4A16 split-count rule
(batch invariance), and emulations
of the W4A16 and W8A8 tile loops that run the kernels' own helpers with ldmatrix / mma.sync
emulated lane by lane.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

from compress.ops import kv_int8, reference as ref
from cuda_harness import load_harness, ptr as _p



@pytest.fixture(scope="module")
def lib():
    return load_harness()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 tensor -> its 16-bit patterns as int32 (0..65535)."""
    return t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def _from_bits(b: torch.Tensor, dtype) -> torch.Tensor:
    return b.to(torch.int32).to(torch.int16).view(dtype)


DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


# --- fragment layouts ------------------------------------------------------------------
def _ptx_python(which: int, lane: int, i: int) -> tuple[int, int]:
    """The PTX ISA fragment tables once more, from the ISA's prose."""
    g, t = lane // 4, lane % 4
    if which == 0:  # m16n8k16 A: a0,a1: (g, 2t..), a2,a3: (g+8, ..), a4,a5: (g, 2t+8..), a6,a7
        return g + 8 * (i in (2, 3, 6, 7)), 2 * t + i % 2 + 8 * (i >= 4)
    if which == 1:  # m16n8k16 B: b0,b1 rows 2t..; b2,b3 rows 2t+8..; col g
        return 2 * t + i % 2 + 8 * (i >= 2), g
    if which == 2:  # m16n8k32 s8 A: a0..a3 (g, 4t..), a4..a7 (g+8), a8..a11 (g, 4t+16..), a12..
        return g + 8 * (4 <= i < 8 or i >= 12), 4 * t + i % 4 + 16 * (i >= 8)
    if which == 3:  # m16n8k32 s8 B
        return 4 * t + i % 4 + 16 * (i >= 4), g
    return g + 8 * (i >= 2), 2 * t + i % 2  # C / D


@pytest.mark.parametrize("which,shape", [(0, (16, 16)), (1, (16, 8)), (2, (16, 32)), (3, (32, 8)), (4, (16, 8))])
def test_fragment_coords_match_ptx(lib, which, shape):
    e = {0: 8, 1: 4, 2: 16, 3: 8, 4: 4}[which]
    bufs = [torch.zeros(32 * e, dtype=torch.int32) for _ in range(4)]
    assert lib.cpk_frag_coords(which, *map(_p, bufs)) == e
    rows, cols, prow, pcol = (b.tolist() for b in bufs)
    expect = [_ptx_python(which, lane, i) for lane in range(32) for i in range(e)]
    assert list(zip(rows, cols)) == expect
    assert list(zip(prow, pcol)) == expect
    assert sorted(expect) == [(r, c) for r in range(shape[0]) for c in range(shape[1])]  # bijection


def test_ldmatrix_addressing_gives_a_fragment(lib):
    rows, chunks = torch.zeros(32, dtype=torch.int32), torch.zeros(32, dtype=torch.int32)
    lib.cpk_ldsm_rows(_p(rows), _p(chunks))
    for lane in range(32):
        for reg in range(4):
            # ldmatrix: register reg of lane = row lane//4 of the matrix whose rows lanes 8*reg.. address
            src = 8 * reg + lane // 4
            r, col0 = rows[src].item(), 8 * chunks[src].item() + 2 * (lane % 4)
            assert (r, col0) == _ptx_python(0, lane, 2 * reg)


def test_swizzle_is_bijective_and_conflict_free(lib):
    out = torch.zeros(64 * 8, dtype=torch.int32)
    lib.cpk_swz128(64, _p(out))
    table = out.view(64, 8)
    for r in range(64):
        assert sorted((table[r] - 8 * r).tolist()) == list(range(8))
    for r0 in range(0, 64, 8):  # one ldmatrix phase: 8 consecutive rows, same logical chunk
        for c in range(8):
            banks = {(table[r0 + i, c].item() % 8) for i in range(8)}
            assert len(banks) == 8


def test_split_range_and_choose_splits(lib):
    for tiles in (1, 5, 64, 173):
        for splits in (1, 2, 3, 7, 16):
            b, e = torch.zeros(splits, dtype=torch.int32), torch.zeros(splits, dtype=torch.int32)
            lib.cpk_split_range(tiles, splits, _p(b), _p(e))
            assert b[0] == 0 and e[-1] == tiles and torch.equal(b[1:], e[:-1])
            assert (e - b).max() - (e - b).min() <= 1
    assert lib.cpk_choose_splits(32, 64, 132, 4) == 16  # 4096x4096 at M=1 on an H100: 512 blocks, 4 k-tiles each
    assert lib.cpk_choose_splits(1000, 64, 132, 4) == 1
    assert lib.cpk_choose_splits(1, 4, 132, 4) == 1


# --- numeric emulation -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["f16", "bf16"])
def test_host_half_rounding_matches_torch(lib, name):
    g = torch.Generator().manual_seed(0)
    vals = torch.cat([torch.randn(20000, generator=g) * 10 ** torch.randint(-9, 6, (20000,), generator=g),
                      torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e-8, 2.0**-24, 3 * 2.0**-25, 1e30,
                                    float("inf"), -float("inf")])]).float()
    out = torch.zeros(vals.numel(), dtype=torch.int16)
    lib.cpk_f32_to_half_bits(int(name == "bf16"), _p(vals), ctypes.c_longlong(vals.numel()), _p(out))
    assert torch.equal(out, vals.to(DTYPES[name]).view(torch.int16))


def _dequant(lib, name, words, s0, s1, z0, z1):
    n = words.numel()
    out = torch.zeros(n * 4, dtype=torch.int32)
    s0b, s1b = (_bits(s.to(DTYPES[name])) * 0x10001 for s in (s0, s1))
    args = [words.to(torch.int32), s0b.to(torch.int32), s1b.to(torch.int32), z0.to(torch.int32), z1.to(torch.int32)]
    lib.cpk_w4_dequant(int(name == "bf16"), ctypes.c_longlong(n), *map(_p, args), _p(out))
    regs = out.view(n, 4)
    lo, hi = regs & 0xFFFF, (regs >> 16) & 0xFFFF
    return _from_bits(torch.stack([lo, hi], -1), DTYPES[name])  # [n, reg, half]


@pytest.mark.parametrize("name", ["f16", "bf16"])
def test_dequant_exhaustive(lib, name):
    """All 16 nibbles x 16 zero points, several scales: every output is (u - z) * s rounded once."""
    dtype = DTYPES[name]
    scales = torch.tensor([1.0, 0.0123, -0.5, 3.7e-3, 17.25, 6.1e-5, 1e-7], dtype=torch.float32).to(dtype)
    u, z, s = torch.meshgrid(torch.arange(16), torch.arange(16), torch.arange(len(scales)), indexing="ij")
    u, z, s = u.reshape(-1), z.reshape(-1), scales[s.reshape(-1)]
    words = (u.to(torch.int64) * 0x11111111)
    words = torch.where(words >= 2**31, words - 2**32, words)
    got = _dequant(lib, name, words, s, s, z, z)
    want = ((u - z).float() * s.float()).to(dtype)
    assert torch.equal(got.view(torch.int16), want[:, None, None].expand_as(got).contiguous().view(torch.int16))


@pytest.mark.parametrize("name", ["f16", "bf16"])
def test_dequant_nibble_positions(lib, name):
    """Register r, half h comes from nibble r + 4h; registers 0,1 use (s0, z0), 2,3 (s1, z1)."""
    dtype = DTYPES[name]
    g = torch.Generator().manual_seed(1)
    n = 4096
    nib = torch.randint(0, 16, (n, 8), generator=g)
    words = (nib << (4 * torch.arange(8))).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    z0, z1 = torch.randint(0, 16, (n,), generator=g), torch.randint(0, 16, (n,), generator=g)
    s0, s1 = (torch.rand(n, generator=g) + 0.01).to(dtype), (torch.rand(n, generator=g) - 0.5).to(dtype)
    got = _dequant(lib, name, words, s0, s1, z0, z1)
    for r in range(4):
        zs, ss = (z0, s0) if r < 2 else (z1, s1)
        for h in range(2):
            want = ((nib[:, r + 4 * h] - zs).float() * ss.float()).to(dtype)
            assert torch.equal(got[:, r, h], want)


def test_dequant_fp16_subnormal_scales_error_bound(lib):
    """fp16 activations take the scales in fp16 (the op converts them): below 6.1e-5 a scale
    is subnormal, spacing 2^-24. Stated in csrc/README.md: every dequantized weight stays
    within 2^-20 of (u - z) * s with the exact scale (15 * 2^-25 from the scale, at most
    2^-22 from the product's rounding), however small s is."""
    s = torch.logspace(-8, -4.2, 97, dtype=torch.float64).float()  # 1e-8 .. 6.3e-5
    u, z, si = torch.meshgrid(torch.arange(16), torch.arange(16), torch.arange(s.numel()), indexing="ij")
    u, z, sv = u.reshape(-1), z.reshape(-1), s[si.reshape(-1)]
    words = u.to(torch.int64) * 0x11111111
    words = torch.where(words >= 2**31, words - 2**32, words)
    got = _dequant(lib, "f16", words, sv, sv, z, z)[:, 0, 0].double()
    exact = (u - z).double() * sv.double()
    assert ((got - exact).abs() <= 2.0**-20).all()
    assert ((got - exact).abs() > 2.0**-22).any()  # the bound is not loose by orders of magnitude


# --- int4 shuffle ------------------------------------------------------------------------
def _rand_int4(n, k, group, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = ref.pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    return q, scales, zeros


@pytest.mark.parametrize("n,k", [(128, 64), (200, 320), (5, 8), (130, 1000)])
def test_shuffle_matches_reference(lib, n, k):
    q, s, z = _rand_int4(n, k, 8, torch.float16)
    qs_ref, _, _ = ref.w4a16_shuffle_for_cuda(q, s, z, 8)
    out = torch.zeros_like(qs_ref)
    lib.cpk_w4_shuffle(_p(q), n, k, _p(out))
    assert torch.equal(out, qs_ref)


def test_shuffled_words_are_mma_b_fragments(lib):
    """Decode every shuffled word through the PTX B-fragment table: register r, half h of
    lane's word at (nt, kb, ks) is element 2*(r%2)+h of n8 tile r//2's B fragment."""
    n, k = 256, 128
    q, s, z = _rand_int4(n, k, 32, torch.float16, seed=3)
    u = ref.unpack_int4(q)
    qs = torch.zeros(n * k // 8, dtype=torch.int32)
    lib.cpk_w4_shuffle(_p(q), n, k, _p(qs))
    words = qs.view(n // 16, k // 64, 32, 4).to(torch.int64) & 0xFFFFFFFF
    for nt in range(0, n // 16, 5):
        for kb in range(k // 64):
            for lane in range(32):
                for ks in range(4):
                    w = words[nt, kb, lane, ks].item()
                    for r in range(4):
                        for h in range(2):
                            nib = (w >> (4 * (r + 4 * h))) & 0xF
                            kk, nn = _ptx_python(1, lane, 2 * (r % 2) + h)
                            assert nib == u[16 * nt + 8 * (r // 2) + nn, 64 * kb + 16 * ks + kk]


# --- tile-loop emulation -------------------------------------------------------------------
def _mt_for(m):
    return 1 if m <= 16 else 2 if m <= 32 else 4


W4_CASES = [  # m, n, k, group, splits
    (1, 128, 64, 64, 1), (5, 200, 320, 32, 3), (17, 130, 256, 128, 2), (40, 64, 192, 16, 1), (70, 256, 128, 64, 2),
    # K not a multiple of 64 (a zero-filled tail in the last k-tile), groups that do not divide 64
    (3, 136, 144, 48, 1), (9, 200, 240, 80, 2), (33, 256, 1008, 112, 3)]


@pytest.mark.parametrize("name", ["f16", "bf16"])
@pytest.mark.parametrize("m,n,k,group,splits", W4_CASES)
def test_w4a16_tile_loop_emulation(lib, name, m, n, k, group, splits):
    dtype = DTYPES[name]
    q, s, z = _rand_int4(n, k, group, dtype, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    qs, st, zt = ref.w4a16_shuffle_for_cuda(q, s, z, group)
    np_, kp = st.shape[1], qs.shape[1] // 2
    y = torch.zeros(m, n, dtype=torch.float32)
    rc = lib.cpk_w4a16_emulate(int(name == "bf16"), _p(x), m, k, _p(qs), _p(st.contiguous()), _p(zt), n, np_, kp,
                               group, _mt_for(m), splits, _p(y))
    assert rc == 0
    # the kernel multiplies by (u - z) * s rounded to the activation dtype, accumulates in fp32
    w = ref.dequantize_int4(q, s, z, group, torch.float32).to(dtype).float()
    torch.testing.assert_close(y, x.float() @ w.t(), rtol=1e-4, atol=1e-4)
    want = ref.w4a16_gemm(x, q, s, z, group).float()
    sqnr = 10 * torch.log10(want.pow(2).sum() / (y.to(dtype).float() - want).pow(2).sum().clamp_min(1e-30))
    assert sqnr > (40 if name == "f16" else 30)


W8_CASES = [(1, 128, 128, 1), (5, 200, 320, 3), (17, 130, 256, 2), (40, 64, 48, 1), (70, 250, 400, 2)]


@pytest.mark.parametrize("m,n,kq,splits", W8_CASES)
def test_w8a8_tile_loop_emulation(lib, m, n, kq, splits):
    g = torch.Generator().manual_seed(m)
    xq = torch.randint(-127, 128, (m, kq), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (n, kq), generator=g, dtype=torch.int8)
    out = torch.zeros(m, n, dtype=torch.int32)
    assert lib.cpk_w8a8_emulate(_p(xq), m, kq, _p(wq), n, _mt_for(m), splits, _p(out)) == 0
    assert torch.equal(out, (xq.to(torch.int64) @ wq.to(torch.int64).t()).to(torch.int32))


@pytest.mark.parametrize("name", ["f16", "bf16", "f32"])
def test_quantize_rows_matches_reference(lib, name):
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[name]
    g = torch.Generator().manual_seed(2)
    m, k = 9, 300
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[3] = 0  # all-zero row: scale clamps to 1e-10 / 127
    x[4, 5] = 2.5 * x[4].abs().max()
    idx = torch.tensor([5, 17, 299])
    x[:, idx] *= 40
    for outliers in (False, True):
        mask = torch.zeros(k, dtype=torch.uint8)
        x_rest = x.clone()
        if outliers:
            mask[idx] = 1
            x_rest[:, idx] = 0
        xf = x.float().contiguous()
        q, scale = torch.zeros(m, k, dtype=torch.int8), torch.zeros(m, dtype=torch.float32)
        lib.cpk_quantize_rows(_p(xf), m, k, _p(mask), _p(q), _p(scale))
        q_ref, s_ref = ref.quantize_per_token_int8(x_rest)
        assert torch.equal(scale, s_ref)
        assert torch.equal(q, q_ref)


# --- reference of the CUDA-layout ops (pure PyTorch; runs everywhere) ----------------
@pytest.mark.parametrize("n,k,group", [(200, 320, 32), (5, 96, 32), (128, 4096, 128)])
def test_shuffled_reference_ops_roundtrip(n, k, group):
    import compress.ops  # noqa: F401  (registers the ops)
    q, s, z = _rand_int4(n, k, group, torch.bfloat16, seed=n)
    qs, st, zt = torch.ops.compress.w4a16_shuffle_for_cuda(q, s, z, group)
    assert qs.shape == (ref._round_up(n, 128) // 16, ref._round_up(k, 64) * 2)
    back = ref.w4a16_unshuffle_cuda(qs, st, zt, n, k, group)
    for a, b in zip(back, (q, s, z)):
        assert torch.equal(a, b)
    x = torch.randn(3, k).to(torch.bfloat16)
    # both on the reference: a native CPU w4a16_gemm accumulates in another order
    assert torch.equal(torch.ops.compress.w4a16_gemm_shuffled(x, qs, st, zt, group, n),
                       ref.w4a16_gemm(x, q, s, z, group))


# --- batch invariance of W4A16 (w4a16_tile.cuh: w4_splits) --------------------------------
@pytest.mark.parametrize("np_,kp", [(4096, 4096), (11008, 4096), (4096, 11008), (128, 64), (256, 1024)])
@pytest.mark.parametrize("sms", [108, 132])
def test_w4a16_split_count_does_not_depend_on_m_in_decode_batches(lib, np_, kp, sms):
    limit = lib.cpk_w4_invariant_rows()
    assert limit == 64 and lib.cpk_w4_block_rows(limit) == limit  # one block row up to the limit
    alone = lib.cpk_w4_splits(1, np_, kp, sms)
    assert all(lib.cpk_w4_splits(m, np_, kp, sms) == alone for m in range(1, limit + 1))


def test_w4a16_split_count_falls_past_the_invariant_rows(lib):
    # 4096 x 4096 on 132 SMs: 16 splits for one block row, 8 for two (M = 65)
    assert lib.cpk_w4_splits(64, 4096, 4096, 132) == 16 and lib.cpk_w4_splits(65, 4096, 4096, 132) == 8


def _emulate_w4a16(lib, name, x, q, s, z, group, splits):
    qs, st, zt = ref.w4a16_shuffle_for_cuda(q, s, z, group)
    m, k = x.shape
    y = torch.zeros(m, q.shape[0], dtype=torch.float32)
    assert lib.cpk_w4a16_emulate(int(name == "bf16"), _p(x.contiguous()), m, k, _p(qs), _p(st.contiguous()), _p(zt),
                                 q.shape[0], st.shape[1], qs.shape[1] // 2, group, _mt_for(m), splits, _p(y)) == 0
    return y


@pytest.mark.parametrize("name", ["f16", "bf16"])
def test_w4a16_rows_of_a_batch_equal_rows_alone_in_emulation(lib, name):
    """Every row of a 40-row batch (MT = 4) gets the fp32 bits it gets alone (MT = 1), with
    the split count the launcher picks for both (4 here)."""
    dtype = DTYPES[name]
    n, k, group, m = 256, 1024, 128, 40
    q, s, z = _rand_int4(n, k, group, dtype, seed=5)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(dtype)
    splits = lib.cpk_w4_splits(m, 256, 1024, 132)
    assert splits == lib.cpk_w4_splits(1, 256, 1024, 132) == 4
    batch = _emulate_w4a16(lib, name, x, q, s, z, group, splits)
    for i in (0, 17, 39):
        assert torch.equal(batch[i], _emulate_w4a16(lib, name, x[i:i + 1], q, s, z, group, splits)[0])


# --- the quantize kernel's outlier pass and shared memory (w8a8.cu) -------------------------
def test_outlier_columns_wrap_like_the_reference(lib):
    k = 300
    assert [lib.cpk_outlier_column(ctypes.c_longlong(j), k) for j in (0, 299, -1, -300, 300, -301, 2**40)] == \
        [0, 299, 299, 0, -1, -1, -1]
    x = torch.arange(k)
    assert x[-1] == x[299] and x[-300] == x[0]  # the reference's indexing


@pytest.mark.parametrize("k", [4096, 49152, 65536, 132104])
def test_quantize_outlier_mask_fits_the_default_shared_memory(lib, k):
    """The mask is a bit per column: with the kernel's 32 static bytes (its reduction
    buffer) it stays under 48 KiB up to the int32 K limit, so no opt-in is needed. A byte
    mask of K = 49152 does not fit beside the static bytes, which the launcher accounts for."""
    static = 32
    assert lib.cpk_quantize_rows_smem_bytes(k, 3) == 4 * ((k + 31) // 32)
    assert lib.cpk_quantize_rows_smem_bytes(k, 0) == 0
    assert not lib.cpk_smem_needs_optin(lib.cpk_quantize_rows_smem_bytes(k, 3), static)
    assert lib.cpk_smem_needs_optin(49152, static) and not lib.cpk_smem_needs_optin(49152 - static, static)
    assert lib.cpk_max_int8_dot_k() == 132104 and 132104 * 127 * 128 < 2**31 <= 132105 * 127 * 128


@pytest.mark.parametrize("k", [300, 49157])
def test_quantize_outlier_pass_matches_reference(lib, k):
    """Negative indices name columns from the end (as x[:, idx] does), a duplicate is
    gathered twice, an index out of range gathers 0 and leaves every column in."""
    g = torch.Generator().manual_seed(4)
    m, ldq = 3, (k + 15) // 16 * 16
    x = torch.randn(m, k, generator=g) * 2
    valid = torch.tensor([5, -1, 17, -k, 5])
    x[:, valid] *= 30
    for idx in (valid, torch.cat([valid, torch.tensor([k, -k - 1])])):
        q, scale = torch.zeros(m, ldq, dtype=torch.int8), torch.zeros(m)
        xo = torch.full((m, idx.numel()), float("nan"))
        assert lib.cpk_quantize_rows_outliers(_p(x), m, k, ldq, _p(idx), idx.numel(), _p(q), _p(scale), _p(xo)) == 0
        x_rest = x.clone()
        x_rest[:, valid] = 0
        q_ref, s_ref = ref.quantize_per_token_int8(x_rest)
        assert torch.equal(scale, s_ref) and torch.equal(q[:, :k], q_ref) and not q[:, k:].any()
        assert torch.equal(xo[:, :valid.numel()], x[:, valid]) and not xo[:, valid.numel():].any()


# --- paged decode attention (paged_attention.cu, helpers in paged_attention.cuh) -----------
def _paged_case(lens, hq, hkv, d, block_size, seed=5):
    """Rows' blocks drawn from a shuffled pool (never in order), -1 past each row's blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    nb = sum(need) + 2
    order = torch.randperm(nb, generator=g).tolist()
    tables = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    for r, n in enumerate(need):
        tables[r, :n] = torch.tensor(order[sum(need[:r]):sum(need[:r]) + n], dtype=torch.int32)
    k, v = torch.randn(nb, hkv, block_size, d, generator=g), torch.randn(nb, hkv, block_size, d, generator=g)
    return torch.randn(len(lens), hq, d, generator=g), k, v, tables, torch.tensor(lens, dtype=torch.int32)


KERNELS = ["split", "heads"]


def _paged_emulated(lib, q, k, v, tables, lens, window, kernel="split"):
    """The emulated kernel (the split kernel, or the per-query-head one) over float32
    pools, or int8 pools of rows ``[D + 4]``."""
    out = torch.full(q.shape, float("nan"))
    name = "cpk_paged_attention_split_emulated" if kernel == "split" else "cpk_paged_attention_emulated"
    fn = getattr(lib, name + ("_int8" if k.dtype == torch.int8 else ""))
    fn(_p(q), _p(k), _p(v), _p(tables), _p(lens), q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[0],
       k.shape[2], tables.shape[1], window, _p(out))
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("d", [64, 128, 80, 256])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1), (12, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("window", [0, 1, 7, 21, 300])
def test_paged_attention_kernel_matches_reference(lib, kernel, d, heads, window):
    """Each kernel's loop structure with its own helpers (split: a thread per key, a warp
    per head's softmax, splits of 256 positions and their combine; heads: warps striding
    over a row's positions, lanes over head_dim chunks, online softmax per warp), at
    lengths around block and split boundaries (1, BS-1, BS, BS+1, 3 BS+5, 256, 257, 600),
    GQA groups of 1, 4, 8 and 12 (two groups of query heads a block) and windows."""
    bs = 16
    q, k, v, tables, lens = _paged_case([1, bs - 1, bs, bs + 1, 3 * bs + 5, 256, 257, 600], *heads, d, bs)
    got = _paged_emulated(lib, q, k, v, tables, lens, window, kernel)
    torch.testing.assert_close(got, ref.paged_decode_attention(q, k, v, tables, lens, window), rtol=1e-5, atol=1e-5)


def test_paged_attention_split_kernel_gives_a_row_its_bits_whatever_its_batch(lib):
    """The split length is fixed: a row's output does not depend on the rows beside it or
    on the table's width (the CUDA graphs' tables are wider than a step needs)."""
    q, k, v, tables, lens = _paged_case([700, 3, 300, 40], 8, 2, 64, 16)
    together = _paged_emulated(lib, q, k, v, tables, lens, 0)
    wide = torch.cat([tables, torch.full((4, 40), -1, dtype=torch.int32)], dim=1).contiguous()
    for r in range(4):
        alone = _paged_emulated(lib, q[r:r + 1].contiguous(), k, v, wide[r:r + 1].contiguous(), lens[r:r + 1], 0)
        assert torch.equal(alone[0], together[r])


@pytest.mark.parametrize("kernel", KERNELS)
def test_paged_attention_kernel_out_of_contract_reads_nothing_outside(lib, kernel):
    """Table entries outside the pool are left out, a length past the table's capacity is
    clamped, a length of 0 gives zeros: the kernel never forms an address outside the pools."""
    q, k, v, tables, lens = _paged_case([20, 5, 9], 4, 2, 64, 8)
    bad = tables.clone()
    bad[0, 1] = k.shape[0]          # positions 8..15 of row 0 name no block
    lens_bad = lens.clone()
    lens_bad[1] = 10_000            # clamped to the row's table capacity
    lens_bad[2] = 0                 # no key
    got = _paged_emulated(lib, q, k, v, bad, lens_bad, 0, kernel)
    assert torch.isfinite(got).all() and not got[2].any()
    keep = torch.tensor([p for p in range(20) if not 8 <= p < 16])  # row 0 without its missing block
    k0 = torch.stack([k[int(tables[0, p // 8]), :, p % 8] for p in keep.tolist()])
    v0 = torch.stack([v[int(tables[0, p // 8]), :, p % 8] for p in keep.tolist()])
    want0 = torch.softmax(torch.einsum("hd,shd->hs", q[0], k0.repeat_interleave(2, dim=1)) / 8, dim=-1)
    torch.testing.assert_close(got[0], torch.einsum("hs,shd->hd", want0, v0.repeat_interleave(2, dim=1)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("d", [64, 20, 18, 128])
@pytest.mark.parametrize("window", [0, 7])
def test_paged_attention_kernel_reads_int8_rows(lib, kernel, d, window):
    """int8 pools (kv_cache_dtype int8): the kernel reads each row's values and the fp32
    scale after them (unaligned where D + 4 is not a multiple of 4: D = 18) and matches
    the reference on the same rows, GQA, block boundaries and windows."""
    bs = 16
    q, k, v, tables, lens = _paged_case([1, bs - 1, bs, bs + 1, 3 * bs + 5, 300], 8, 2, d, bs)
    k8, v8 = kv_int8.quantize_rows(k), kv_int8.quantize_rows(v)
    got = _paged_emulated(lib, q, k8, v8, tables, lens, window, kernel)
    torch.testing.assert_close(got, ref.paged_decode_attention(q, k8, v8, tables, lens, window), rtol=1e-5,
                               atol=1e-5)
    # the float kernel on the rows read back: the same arithmetic, so the same bits
    back = _paged_emulated(lib, q, kv_int8.dequantize_rows(k8), kv_int8.dequantize_rows(v8), tables, lens, window,
                           kernel)
    assert torch.equal(got, back)


def test_paged_int8_row_scale_reads_the_four_bytes_after_the_values_at_any_alignment(lib):
    lib.cpk_paged_int8_row_scale.restype = ctypes.c_float
    rows = kv_int8.quantize_rows(torch.randn(7, 18, generator=torch.Generator().manual_seed(3)) * 5)
    flat = rows.reshape(-1)  # 22-byte rows: every other row's scale is unaligned
    for r in range(rows.shape[0]):
        got = lib.cpk_paged_int8_row_scale(ctypes.c_void_p(flat.data_ptr() + 22 * r), 18)
        assert got == kv_int8.row_scales(rows)[r].item() and got > 0
