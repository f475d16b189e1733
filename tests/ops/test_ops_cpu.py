"""Every compress op's CPU kernel, on every ISA this machine has (the best one, forced
AVX2, forced scalar; the `isa` fixture of tests/ops/conftest.py), against the pure-PyTorch
reference over odd shapes; opcheck."""
from __future__ import annotations

import pytest
import torch

import compress.ops as ops
from compress.ops import reference
from int_weights import make_int4, make_int8
from compress.accuracy import sqnr_db

pytestmark = pytest.mark.skipif(not ops.native_available("cpu"), reason="compress._C not built")


@pytest.fixture(autouse=True)
def _int8_tiles():
    """w4a8_gemm* against its int8-activation reference: on CPUs with AMX-BF16 the op takes
    bf16 tiles from 16 rows (other numbers, held to the reference by SQNR in
    test_w4a16_amx.py), so here they stay off."""
    if not ops.native_available("cpu"):
        yield
        return
    before = ops.set_w4a16_amx_min_rows(1 << 62)
    try:
        yield
    finally:
        ops.set_w4a16_amx_min_rows(before)


# (M, N, K, group): M odd / 1 / beyond a tile; K == group; N small; K % 64 == 32.
W4_SHAPES = [(1, 8, 32, 32), (3, 5, 96, 32), (7, 33, 128, 64), (1, 24, 256, 128), (17, 9, 384, 128),
             (5, 70, 192, 64), (66, 12, 64, 64), (2, 3, 4096, 128), (1, 37, 512, 128), (1, 12, 128, 32),
             (3, 10, 128, 16), (7, 14, 256, 32)]


# The two int4 ops: float activations (the w4a16 scheme's numbers) and int8 activations
# per block of 32 (the CPU fast path); each against its own reference.
W4_OPS = ["w4a16_gemm", "w4a8_gemm"]


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: the kernels' sums differ from the reference's only in order (~1e-7 of the
    largest output); bf16: both round an fp32 result, at most an ulp apart."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    scale = ref.float().abs().max().item()
    tol = 1e-5 if ref.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("shape", W4_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", W4_OPS)
def test_w4_ops_match_reference(isa, shape, dtype, op):
    m, n, k, group = shape
    qweight, scales, zeros = make_int4(n, k, group)
    x = torch.randn(m, k).to(dtype)
    ref = ops.get_op(op, "reference")(x, qweight, scales, zeros, group)
    assert_close_to_reference(ops.get_op(op)(x, qweight, scales, zeros, group), ref)


@pytest.mark.parametrize("shape", W4_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", W4_OPS)
def test_w4_prepared_matches_canonical(isa, shape, op):
    """The runtime's entry (row-tiled qweight, fp32 scales, uint8 zeros, made once at
    load time) computes what the canonical entry computes, and its reference is the
    canonical one."""
    m, n, k, group = shape
    qweight, scales, zeros = make_int4(n, k, group)
    x = torch.randn(m, k)
    prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    out = ops.get_op(op + "_prepared")(x, *prepared, group)
    ref = ops.get_op(op + "_prepared", "reference")(x, *prepared, group)
    torch.testing.assert_close(ref, ops.get_op(op, "reference")(x, qweight, scales, zeros, group), rtol=0, atol=0)
    torch.testing.assert_close(out, ops.get_op(op)(x, qweight, scales, zeros, group), rtol=1e-5, atol=1e-5)
    assert_close_to_reference(out, ref)


@pytest.mark.parametrize("n,k", [(8, 128), (11, 256), (3, 64), (9, 96), (6, 32)])
def test_w4a16_tile_cpu_layout(n, k):
    """The load-time tiling interleaves the 32-byte chunks of each group of 4 rows when
    K % 64 == 0 (rows past the last full tile, and every row otherwise, stay row-major),
    and untiling restores the canonical tensor exactly."""
    qweight = make_int4(n, k, 32)[0]
    tiled = reference.w4a16_tile_cpu(qweight)
    assert tiled.shape == qweight.shape and tiled.dtype == qweight.dtype
    torch.testing.assert_close(reference.w4a16_untile_cpu(tiled), qweight, rtol=0, atol=0)
    n4 = n - n % 4 if k % 64 == 0 else 0
    flat, words = tiled.reshape(-1), k // 8
    for row in range(n):
        for chunk in range(words // 8):
            start = (row // 4) * 4 * words + chunk * 32 + (row % 4) * 8 if row < n4 else row * words + chunk * 8
            torch.testing.assert_close(flat[start:start + 8], qweight[row, chunk * 8:chunk * 8 + 8], rtol=0, atol=0)


@pytest.mark.parametrize("op", W4_OPS)
def test_w4_prepared_rejects_unprepared_scales(op):
    qweight, scales, zeros = make_int4(8, 64, 32)
    prepared = ops.get_op(op + "_prepared")
    with pytest.raises(RuntimeError, match="scale must be contiguous float32 and zeros contiguous uint8"):
        prepared(torch.randn(1, 64), qweight, scales.half(), zeros, 32)
    with pytest.raises(RuntimeError, match="scale must be contiguous float32 and zeros contiguous uint8"):
        prepared(torch.randn(1, 64), qweight, scales.float(), zeros.float(), 32)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", W4_OPS)
def test_w4_scale_dtypes_and_odd_group(isa, scale_dtype, op):
    qweight, scales, zeros = make_int4(10, 96, 32, scale_dtype)
    x = torch.randn(3, 96)
    assert_close_to_reference(ops.get_op(op)(x, qweight, scales, zeros, 32),
                              ops.get_op(op, "reference")(x, qweight, scales, zeros, 32))
    # groups the tiles do not take (16; 96 and 160, multiples of 32 but not of 64, which
    # the int8 tiles once took and got wrong): float activations against weights
    # dequantized in K order, canonical and prepared, for both ops (reference.w4a8_gemm)
    for group, k in ((16, 96), (96, 192), (160, 320)):
        qweight, scales, zeros = make_int4(10, k, group, scale_dtype)
        x = torch.randn(3, k)
        ref = reference.w4a16_gemm(x, qweight, scales, zeros, group)
        torch.testing.assert_close(ops.get_op(op, "reference")(x, qweight, scales, zeros, group), ref, rtol=0, atol=0)
        torch.testing.assert_close(ops.get_op(op)(x, qweight, scales, zeros, group), ref, rtol=1e-5, atol=1e-5)
        prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
        torch.testing.assert_close(ops.get_op(op + "_prepared")(x, *prepared, group), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ops.native_available("cpu") or "avx512_vnni" not in ops.cpu_isas_available(),
                    reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("shape", [(1, 8, 64, 32), (1, 37, 512, 128), (3, 70, 4096, 128), (2, 9, 192, 64),
                                   (17, 12, 256, 32), (1, 6, 96, 32)], ids=lambda s: "x".join(map(str, s)))
def test_w4a8_vnni_tiles_equal_avx2_bit_for_bit(shape):
    """On real AVX-512 VNNI hardware (the emulation harness checks the same under SIMDe)
    the int8-activation VNNI tiles give the AVX2 tiles' bytes, canonical and prepared,
    below the AMX and panel row thresholds: vpdpbusd's int32 sums are vpmaddubsw +
    vpmaddwd's (the panel GEMM sums in another order: tests/ops/test_w4_panels.py)."""
    m, n, k, group = shape
    qweight, scales, zeros = make_int4(n, k, group)
    prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    x = torch.randn(m, k)
    outs = {}
    panel_rows = ops.set_w4a8_panel_min_rows(1 << 62)
    try:
        for name in ("avx512_vnni", "avx2"):
            with ops.force_cpu_isa(name):
                outs[name] = (torch.ops.compress.w4a8_gemm_prepared(x, *prepared, group),
                              torch.ops.compress.w4a8_gemm(x, qweight, scales, zeros, group))
    finally:
        ops.set_w4a8_panel_min_rows(panel_rows)
    for vnni, avx2 in zip(outs["avx512_vnni"], outs["avx2"]):
        assert torch.equal(vnni, avx2)


@pytest.mark.skipif(not ops.native_available("cpu") or "avx512_vnni" not in ops.cpu_isas_available(),
                    reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 11, 13])
@pytest.mark.parametrize("group", [32, 128])
def test_w4a8_shared_unpack_tiles_equal_per_row_tiles(m, group):
    """The few-row tiles that unpack a weight chunk once for up to eight activation rows
    give the bytes of the tiles that unpack it per row (odd row counts take the 7..1-row
    remainders; 13 rows one tile of eight and one of five)."""
    qweight, scales, zeros = make_int4(70, 512, group)
    prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    x = torch.randn(m, 512)
    panel_rows = ops.set_w4a8_panel_min_rows(1 << 62)
    before = ops.set_w4a8_shared_unpack(False)
    try:
        with ops.force_cpu_isa("avx512_vnni"):
            per_row = torch.ops.compress.w4a8_gemm_prepared(x, *prepared, group)
            assert ops.set_w4a8_shared_unpack(True) is False
            shared = torch.ops.compress.w4a8_gemm_prepared(x, *prepared, group)
    finally:
        ops.set_w4a8_shared_unpack(before)
        ops.set_w4a8_panel_min_rows(panel_rows)
    assert torch.equal(shared, per_row)
    assert sqnr_db(reference.w4a8_gemm(x, qweight, scales, zeros, group), shared) > 60


@pytest.mark.parametrize("m,n,k,group", [(9, 37, 320, 64), (1, 13, 96, 32), (4, 8, 1024, 128)])
@pytest.mark.parametrize("op", W4_OPS)
def test_w4_isas_agree(m, n, k, group, op):
    """The ISAs differ only in fp32 sum order (for the int8 op: the scalar and the AVX2
    activation quantizers give the same bytes); canonical and prepared entries, fp32 and
    bf16 x."""
    qweight, scales, zeros = make_int4(n, k, group)
    prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    x = torch.randn(m, k) * torch.logspace(-2, 1, k)  # blocks of very different ranges
    canonical, on_prepared = ops.get_op(op), ops.get_op(op + "_prepared")
    outs = []
    for name in ops.cpu_isas_available():
        with ops.force_cpu_isa(name):
            outs.append([canonical(x, qweight, scales, zeros, group), on_prepared(x, *prepared, group),
                         on_prepared(x.bfloat16(), *prepared, group).float()])
    for other in outs[1:]:
        for o, first in zip(other, outs[0]):
            torch.testing.assert_close(o, first, rtol=1e-4, atol=1e-4)


W8_SHAPES = [(1, 8, 32), (3, 5, 17), (7, 33, 100), (1, 24, 4096), (17, 9, 255), (66, 12, 64), (5, 3, 1000)]


@pytest.mark.parametrize("shape", W8_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_matches_reference(isa, shape, dtype):
    m, n, k = shape
    q, s = make_int8(n, k)
    x = torch.randn(m, k).to(dtype)
    ref = reference.w8a8_gemm(x, q, s)
    out = torch.ops.compress.w8a8_gemm(x, q, s)
    assert out.dtype == dtype and out.shape == (m, n)
    # same quantization and exact int32 sums: equal up to the final fp32 rounding
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 8, 64, 1), (3, 5, 17, 2), (7, 33, 200, 3), (17, 40, 1000, 5), (2, 9, 4096, 20)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ow_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_w8a8_outlier_matches_reference(isa, shape, ow_dtype):
    m, n, k, c = shape
    q, s = make_int8(n, k)
    x = torch.randn(m, k)
    idx = torch.randperm(k)[:c]
    x[:, idx] *= 30.0  # outlier features
    ow = (torch.randn(n, c) * 0.05).to(ow_dtype)
    ref = reference.w8a8_outlier_gemm(x, q, s, idx, ow)
    out = torch.ops.compress.w8a8_outlier_gemm(x, q, s, idx, ow)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert sqnr_db(ref, out) > 80


@pytest.mark.parametrize("shape", [(1, 8, 64), (1, 37, 256), (5, 70, 192), (3, 9, 100), (66, 12, 128), (2, 3, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_w8a8_prepared_matches_canonical(isa, shape):
    """The runtime's entries on the load-time row-tiled weights compute exactly what the
    canonical ones compute (same quantization, exact int32 sums), with and without
    fused outlier columns."""
    m, n, k = shape
    q, s = make_int8(n, k)
    tiled = reference.w8a8_tile_cpu(q)
    x = torch.randn(m, k)
    torch.testing.assert_close(torch.ops.compress.w8a8_gemm_prepared(x, tiled, s),
                               torch.ops.compress.w8a8_gemm(x, q, s), rtol=1e-6, atol=1e-6)
    idx = torch.tensor([0, k // 2, k - 1])
    ow = torch.randn(n, 3)
    got = torch.ops.compress.w8a8_outlier_gemm_prepared(x, tiled, s, idx, ow)
    torch.testing.assert_close(got, torch.ops.compress.w8a8_outlier_gemm(x, q, s, idx, ow), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(reference.w8a8_outlier_gemm_prepared(x, tiled, s, idx, ow),
                               reference.w8a8_outlier_gemm(x, q, s, idx, ow), rtol=0, atol=0)


@pytest.mark.parametrize("n,k", [(8, 128), (11, 256), (3, 64), (9, 96)])
def test_w8a8_tile_cpu_layout(n, k):
    """Each group of 4 rows is stored with its 64-byte chunks interleaved when K % 64 == 0;
    the rest stays row-major; untiling restores the canonical tensor exactly."""
    q = make_int8(n, k)[0]
    tiled = reference.w8a8_tile_cpu(q)
    assert tiled.shape == q.shape and tiled.dtype == q.dtype
    assert torch.equal(reference.w8a8_untile_cpu(tiled), q)
    n4 = n - n % 4 if k % 64 == 0 else 0
    flat = tiled.reshape(-1)
    for row in range(n):
        for chunk in range(k // 64):
            start = (row // 4) * 4 * k + chunk * 256 + (row % 4) * 64 if row < n4 else row * k + chunk * 64
            assert torch.equal(flat[start:start + 64], q[row, chunk * 64:chunk * 64 + 64])


def test_w8a8_outlier_no_outliers_equals_w8a8(isa):
    q, s = make_int8(11, 130)
    x = torch.randn(4, 130)
    out = torch.ops.compress.w8a8_outlier_gemm(x, q, s, torch.zeros(0, dtype=torch.long), torch.zeros(11, 0))
    torch.testing.assert_close(out, torch.ops.compress.w8a8_gemm(x, q, s))


@pytest.mark.parametrize("shape", [(1, 7), (5, 33), (3, 4096)])
def test_quantize_per_token_int8_matches_reference(shape):
    x = torch.randn(*shape) * 3
    q, s = torch.ops.compress.quantize_per_token_int8(x)
    rq, rs = reference.quantize_per_token_int8(x)
    assert torch.equal(q, rq)
    torch.testing.assert_close(s, rs)


def test_threads_honoured():
    q, s = make_int8(64, 256)
    x = torch.randn(3, 256)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.compress.w8a8_gemm(x, q, s)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, torch.ops.compress.w8a8_gemm(x, q, s))


def test_isa_override():
    assert ops.cpu_isa() in ("avx512_vnni", "avx2", "scalar")
    with ops.force_cpu_isa("scalar"):
        assert ops.cpu_isa() == "scalar"
    assert ops.cpu_isa() == ops.cpu_isas_available()[0]
    with pytest.raises(ValueError):
        ops.set_cpu_isa("sse9")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 256), (3, 5, 96), (2, 17), (1, 1000)], ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_matches_reference(isa, shape, dtype):
    x, r = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    w = (torch.rand(shape[-1]) + 0.5).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    got = torch.ops.compress.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, reference.rms_norm(x, w, 1e-5), **tol)
    y, h = torch.ops.compress.add_rms_norm(x, r, w, 1e-6)
    y_ref, h_ref = reference.add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)   # the sum is rounded as the plain add
    torch.testing.assert_close(y, y_ref, **tol)


def argmax_cases() -> list[torch.Tensor]:
    """Rows whose answer is easy to get wrong: ties (the first wins), NaN (the first NaN
    wins), infinities, signed zeros, and positions in the vector body and in the tail."""
    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(n, generator=g) for n in (1, 7, 8, 31, 32, 33, 100, 32000)]
    tie = torch.randn(77, generator=g)
    tie[[5, 40, 76]] = 9.0
    late_tie = torch.randn(70, generator=g)
    late_tie[[66, 69]] = 9.0                           # both in the 8-wide tail
    nan = torch.randn(90, generator=g)
    nan[[3, 50]] = 9.0
    nan[[41, 88]] = float("nan")
    tail_nan = torch.randn(37, generator=g)
    tail_nan[35] = float("nan")
    inf = torch.randn(64, generator=g)
    inf[[10, 20]] = float("inf")
    cases += [tie, late_tie, nan, tail_nan, inf, torch.full((19,), float("-inf")), torch.tensor([-0.0, 0.0, -0.0]),
              torch.tensor([0.0, -0.0]), torch.zeros(40)]
    return cases


def test_argmax_rows_matches_torch(isa):
    for row in argmax_cases():
        assert int(torch.ops.compress.argmax_rows(row)) == int(row.argmax()), row
    batch = torch.randn(3, 5, 1000)
    batch[1, 2, [7, 900]] = 50.0
    assert torch.equal(torch.ops.compress.argmax_rows(batch), batch.argmax(-1))
    strided = torch.randn(1000, 6)[:, 1:5].t()             # rows not contiguous
    assert torch.equal(torch.ops.compress.argmax_rows(strided), strided.argmax(-1))
    half = torch.randn(4, 300).bfloat16()                  # other dtypes: torch.argmax
    assert torch.equal(torch.ops.compress.argmax_rows(half), half.argmax(-1))
    got = torch.ops.compress.argmax_rows(torch.randn(2, 9))
    assert got.dtype == torch.int64 and got.shape == (2,)
    with pytest.raises(RuntimeError, match="non-empty last dim"):
        torch.ops.compress.argmax_rows(torch.randn(3, 0))


def test_rms_norm_rejects_mismatched_weight():
    """The numbers in the message too: an extension carrying its own static libstdc++
    printed them as nothing here and crashed on a lent Xeon (csrc/cpu/cxx_runtime.py)."""
    with pytest.raises(RuntimeError, match=r"rms_norm: weight \[7\] must match the last dim of x \[2, 8\]"):
        torch.ops.compress.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("d,s", [(32, 13), (64, 37), (20, 9)], ids=["d32s13", "d64s37", "d20s9"])
@pytest.mark.parametrize("kv_half", [False, True], ids=["kv_same", "kv_f16"])
def test_decode_attention_matches_reference(isa, dtype, heads, masked, d, s, kv_half):
    """fp32 with head_dim % 8 == 0 takes the AVX2 path (grouped heads, vector exp); the
    other cases, and the forced scalar ISA, the generic one. A float16 cache under fp32 /
    bf16 queries is widened as it is read (the reference widens the same values)."""
    hq, hkv = heads
    b, cap = 3, 40
    kv_dtype = torch.float16 if kv_half else dtype
    # the runtime passes slices of a preallocated cache: strided along batch, heads and slots
    k_cache, v_cache = torch.randn(4, hkv, cap, d).to(kv_dtype), torch.randn(4, hkv, cap, d).to(kv_dtype)
    k, v = k_cache[:b, :, :s], v_cache[:b, :, :s]
    q = torch.randn(b, 1, hq, d).to(dtype).transpose(1, 2).squeeze(2)   # non-contiguous, as in the model
    mask = None
    if masked:
        mask = torch.rand(b, s) > 0.4
        mask[:, -1] = True
    got = torch.ops.compress.decode_attention(q, k, v, mask)
    want = reference.decode_attention(q, k, v, mask)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert got.shape == (b, hq * d) and got.dtype == dtype
    torch.testing.assert_close(got, want, **tol)


def test_decode_attention_rejects_bad_shapes():
    q, k = torch.randn(2, 6, 16), torch.randn(2, 4, 5, 16)
    with pytest.raises(RuntimeError, match="Hq % Hkv"):
        torch.ops.compress.decode_attention(q, k, k, None)
    with pytest.raises(RuntimeError, match="mask"):
        torch.ops.compress.decode_attention(torch.randn(2, 4, 16), k, k, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="k and v must both have q's dtype or both float16"):
        torch.ops.compress.decode_attention(torch.randn(2, 4, 16), k.half(), k, None)
    with pytest.raises(RuntimeError, match="k and v must both have q's dtype or both float16"):
        torch.ops.compress.decode_attention(torch.randn(2, 4, 16), k.bfloat16(), k.bfloat16(), None)


def test_gemm_workspaces_past_the_reused_buffer():
    """Workspaces over Scratch's 1 MiB come from their own allocation: a call that needs
    one (M = 300, K = 4096) between two small ones, each against the reference."""
    qweight, scales, zeros = make_int4(8, 4096, 128)
    qt, s32, z8 = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    q8, ws = make_int8(8, 4096)
    q8t = reference.w8a8_tile_cpu(q8)
    for m in (2, 300, 2):
        x = torch.randn(m, 4096)
        for op in W4_OPS:
            assert_close_to_reference(ops.get_op(op + "_prepared")(x, qt, s32, z8, 128),
                                      ops.get_op(op, "reference")(x, qweight, scales, zeros, 128))
        got8 = torch.ops.compress.w8a8_gemm_prepared(x, q8t, ws)
        assert sqnr_db(reference.w8a8_gemm(x, q8, ws), got8) > 35


def test_opcheck():
    qweight, scales, zeros = make_int4(16, 128, 64)
    q, s = make_int8(16, 128)
    x = torch.randn(3, 128)
    idx = torch.tensor([3, 77])
    ow = torch.randn(16, 2)
    cases = [
        (torch.ops.compress.w4a16_gemm.default, (x, qweight, scales, zeros, 64)),
        (torch.ops.compress.w4a16_gemm_prepared.default, (x, *reference.w4a16_prepare_cpu(qweight, scales, zeros), 64)),
        (torch.ops.compress.w4a8_gemm.default, (x, qweight, scales, zeros, 64)),
        (torch.ops.compress.w4a8_gemm_prepared.default, (x, *reference.w4a16_prepare_cpu(qweight, scales, zeros), 64)),
        (torch.ops.compress.w8a8_gemm.default, (x, q, s)),
        (torch.ops.compress.w8a8_outlier_gemm.default, (x, q, s, idx, ow)),
        (torch.ops.compress.w8a8_gemm_prepared.default, (x, reference.w8a8_tile_cpu(q), s)),
        (torch.ops.compress.w8a8_outlier_gemm_prepared.default, (x, reference.w8a8_tile_cpu(q), s, idx, ow)),
        (torch.ops.compress.w8a8_outlier_gemm_prepared.default, (x, reference.w8a8_tile_cpu(q), s, idx, ow, 1.5)),
        (torch.ops.compress.quantize_per_token_int8.default, (x,)),
        (torch.ops.compress.rms_norm.default, (x, torch.rand(128), 1e-5)),
        (torch.ops.compress.add_rms_norm.default, (x, torch.randn(3, 128), torch.rand(128), 1e-5)),
        (torch.ops.compress.argmax_rows.default, (x,)),
        (torch.ops.compress.decode_attention.default,
         (torch.randn(2, 4, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16),
          torch.tensor([[True, False] * 3 + [True]] * 2))),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_dense_gemm_matches_reference_and_each_row_is_its_own(isa, x_dtype, w_dtype):
    """Every row count the kernel takes (1..16, then at::mm), K in the vector body and in
    the tail; a row's result does not depend on the rows beside it (bitwise)."""
    g = torch.Generator().manual_seed(11)
    for m, k, n in [(1, 256, 768), (3, 19, 7), (5, 100, 33), (8, 64, 130), (9, 257, 40), (16, 48, 16), (17, 32, 8),
                    (64, 40, 24), (65, 16, 8)]:
        x = torch.randn(m, k, generator=g).to(x_dtype)
        w = torch.randn(n, k, generator=g).to(w_dtype)
        got = torch.ops.compress.dense_gemm(x, w)
        want = (x.double() @ w.double().t())
        assert got.dtype == x_dtype and got.shape == (m, n)
        tol = 1e-4 * k ** 0.5 if x_dtype == torch.float32 else 2e-2 * k ** 0.5
        assert (got.double() - want).abs().max() < tol, (m, k, n)
        torch.testing.assert_close(got, reference.dense_gemm(x, w), rtol=1e-4 if x_dtype == torch.float32 else 2e-2,
                                   atol=tol)
        for r in (0, m - 1) if m <= 64 else ():     # past 64 rows: at::mm
            assert torch.equal(torch.ops.compress.dense_gemm(x[r:r + 1], w)[0], got[r])
    with pytest.raises(RuntimeError, match="dense_gemm"):
        torch.ops.compress.dense_gemm(torch.randn(2, 5), torch.randn(3, 6))
