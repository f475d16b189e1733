"""GPU suite of the CUDA kernels (compress._cuda): each op against the PyTorch
reference over odd shapes, SQNR thresholds and torch.library.opcheck.

Runs only where torch.cuda.is_available() and the extension is built; skipped, with
the reason shown by ``pytest -ra``, everywhere else (CI has no GPU: see
tests/csrc/test_cuda_host.py for what is verified there).
"""
from __future__ import annotations

import pytest
import torch

import compress.ops as ops
from compress.ops import kv_int8, reference as ref

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU kernel suite skipped"),
    pytest.mark.skipif(torch.cuda.is_available() and not ops.native_available("cuda"),
                       reason="compress._cuda not built (pip install -e . with a CUDA torch and nvcc)"),
]

DEV = "cuda"
C = torch.ops.compress


def sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return (10 * torch.log10(want.pow(2).sum() / (got - want).pow(2).sum().clamp_min(1e-30))).item()


def rand_int4(n, k, group, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = ref.pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    return q.to(DEV), scales.to(DEV), zeros.to(DEV)


def rand_x(m, k, dtype, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


W4_SHAPES = [(1, 128, 64, 64), (3, 200, 320, 32), (17, 130, 1024, 64), (33, 96, 192, 16), (64, 256, 512, 128),
             (100, 4096, 4096, 128), (257, 520, 2048, 128), (1, 11008, 4096, 128), (5, 4096, 11008, 128)]
DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,g", W4_SHAPES)
def test_w4a16_gemm(dtype, m, n, k, g):
    q, s, z = rand_int4(n, k, g, dtype, seed=n + k)
    x = rand_x(m, k, dtype)
    got = C.w4a16_gemm(x, q, s, z, g)
    want = ref.w4a16_gemm(x.cpu(), q.cpu(), s.cpu(), z.cpu(), g)
    assert got.dtype == dtype and got.shape == (m, n)
    assert sqnr_db(got, want) > (45 if dtype == torch.float16 else 35)


# K not a multiple of 64 (zero-filled tail of the last k-tile), groups that do not divide 64
W4_ODD_K_SHAPES = [(3, 136, 144, 48), (17, 200, 240, 80), (40, 256, 1008, 112), (1, 128, 4128, 96)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,g", W4_ODD_K_SHAPES)
def test_w4a16_gemm_odd_k_and_groups(dtype, m, n, k, g):
    q, s, z = rand_int4(n, k, g, dtype, seed=k)
    x = rand_x(m, k, dtype)
    want = ref.w4a16_gemm(x.cpu(), q.cpu(), s.cpu(), z.cpu(), g)
    assert sqnr_db(C.w4a16_gemm(x, q, s, z, g), want) > (45 if dtype == torch.float16 else 35)
    qs, st, zt = C.w4a16_shuffle_for_cuda(q, s, z, g)
    assert sqnr_db(C.w4a16_gemm_shuffled(x, qs, st, zt, g, n), want) > (45 if dtype == torch.float16 else 35)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,g", W4_SHAPES[:6])
def test_w4a16_shuffled_matches_canonical(dtype, m, n, k, g):
    q, s, z = rand_int4(n, k, g, dtype, seed=3)
    x = rand_x(m, k, dtype)
    qs, st, zt = C.w4a16_shuffle_for_cuda(q, s, z, g)
    qs_ref, st_ref, zt_ref = ref.w4a16_shuffle_for_cuda(q.cpu(), s.cpu(), z.cpu(), g)
    assert torch.equal(qs.cpu(), qs_ref) and torch.equal(st.cpu(), st_ref) and torch.equal(zt.cpu(), zt_ref)
    torch.testing.assert_close(C.w4a16_gemm_shuffled(x, qs, st, zt, g, n), C.w4a16_gemm(x, q, s, z, g),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype,g", [(torch.float32, 64), (torch.float16, 8), (torch.bfloat16, 24)])
def test_w4a16_fallback_paths(dtype, g):
    q, s, z = rand_int4(72, 192, g, dtype)
    x = rand_x(5, 192, dtype)
    got = C.w4a16_gemm(x, q, s, z, g)
    assert sqnr_db(got, ref.w4a16_gemm(x.cpu(), q.cpu(), s.cpu(), z.cpu(), g)) > 35


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("m,k", [(1, 64), (7, 300), (33, 4096), (130, 11008)])
def test_quantize_per_token_int8_exact(dtype, m, k):
    x = rand_x(m, k, dtype) * 4
    x[0] = 0
    q, s = C.quantize_per_token_int8(x)
    q_ref, s_ref = ref.quantize_per_token_int8(x.cpu())
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu(), q_ref)


W8_SHAPES = [(1, 128, 128), (3, 200, 320), (17, 130, 72), (33, 96, 1024), (100, 4096, 4096), (257, 520, 2048),
             (1, 11008, 4096), (4, 4096, 11008)]


def rand_int8_weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    scale = w.abs().amax(1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.to(DEV), scale.to(DEV)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("m,n,k", W8_SHAPES)
def test_w8a8_gemm(dtype, m, n, k):
    q, ws = rand_int8_weight(n, k, seed=n)
    x = rand_x(m, k, dtype)
    got = C.w8a8_gemm(x, q, ws)
    want = ref.w8a8_gemm(x.cpu(), q.cpu(), ws.cpu())
    # identical int8 operands and int32 sums; only the final rounding order may differ
    torch.testing.assert_close(got.cpu(), want, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-3)
    assert sqnr_db(got, want) > 60


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,c", [(1, 128, 128, 3), (9, 200, 320, 1), (40, 4096, 4096, 24), (130, 520, 1040, 7)])
def test_w8a8_outlier_gemm(dtype, m, n, k, c):
    q, ws = rand_int8_weight(n, k, seed=k)
    x = rand_x(m, k, dtype)
    idx = torch.randperm(k, generator=torch.Generator().manual_seed(c))[:c].sort().values
    x[:, idx] *= 30
    w_out = (torch.randn(n, c) * 0.05).to(dtype)
    got = C.w8a8_outlier_gemm(x, q, ws, idx.to(DEV), w_out.to(DEV))
    want = ref.w8a8_outlier_gemm(x.cpu(), q.cpu(), ws.cpu(), idx, w_out)
    assert sqnr_db(got, want) > (45 if dtype == torch.float16 else 35)


def test_empty_batch():
    q, s, z = rand_int4(128, 64, 64, torch.float16)
    assert C.w4a16_gemm(rand_x(0, 64, torch.float16), q, s, z, 64).shape == (0, 128)
    qi, ws = rand_int8_weight(128, 64)
    assert C.w8a8_gemm(rand_x(0, 64, torch.float16), qi, ws).shape == (0, 128)


def test_opcheck():
    q, s, z = rand_int4(200, 320, 32, torch.float16)
    x = rand_x(5, 320, torch.float16)
    qs, st, zt = C.w4a16_shuffle_for_cuda(q, s, z, 32)
    qi, ws = rand_int8_weight(200, 320)
    idx = torch.tensor([3, 100], device=DEV)
    w_out = torch.randn(200, 2, device=DEV, dtype=torch.float16)
    cases = [
        (C.w4a16_gemm.default, (x, q, s, z, 32)),
        (C.w4a16_shuffle_for_cuda.default, (q, s, z, 32)),
        (C.w4a16_gemm_shuffled.default, (x, qs, st, zt, 32, 200)),
        (C.quantize_per_token_int8.default, (x,)),
        (C.w8a8_gemm.default, (x, qi, ws)),
        (C.w8a8_outlier_gemm.default, (x, qi, ws, idx, w_out)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


# --- argument checks (csrc/cuda/op_checks.h; host-tested in test_cuda_op_checks.py) ---------------
def test_group_size_that_is_not_positive_is_an_error_not_a_crash():
    q, s, z = rand_int4(128, 64, 64, torch.float16)
    x = rand_x(2, 64, torch.float16)
    qs, st, zt = C.w4a16_shuffle_for_cuda(q, s, z, 64)
    for g in (0, -16):
        with pytest.raises(RuntimeError, match="group_size must be a positive multiple of 16"):
            C.w4a16_gemm_shuffled(x, qs, st, zt, g, 128)
        with pytest.raises(RuntimeError, match="group_size must be positive"):
            C.w4a16_gemm(x, q, s, z, g)
    torch.cuda.synchronize()


def _other_devices():
    return ["cpu"] + (["cuda:1"] if torch.cuda.device_count() > 1 else [])


@pytest.mark.parametrize("where", _other_devices())
def test_every_tensor_argument_must_be_on_x_device(where):
    q, s, z = rand_int4(128, 64, 64, torch.float16)
    x = rand_x(2, 64, torch.float16)
    qs, st, zt = C.w4a16_shuffle_for_cuda(q, s, z, 64)
    qi, ws = rand_int8_weight(128, 64)
    idx, w_out = torch.tensor([3, 9], device=DEV), torch.randn(128, 2, device=DEV, dtype=torch.float16)
    cases = [(C.w4a16_gemm, [x, q, s, z, 64], ["qweight", "scales", "zeros"], 0),
             (C.w4a16_gemm_shuffled, [x, qs, st, zt, 64, 128], ["qweight_shuffled", "scales_t", "zeros_t"], 0),
             (C.w4a16_shuffle_for_cuda, [q, s, z, 64], [None, "scales", "zeros"], -1),
             (C.w8a8_gemm, [x, qi, ws], ["qweight", "weight_scale"], 0),
             (C.w8a8_outlier_gemm, [x, qi, ws, idx, w_out], ["qweight", "weight_scale", "outlier_idx", "outlier_weight"], 0)]
    for op, args, names, shift in cases:
        for i, name in enumerate(names):
            if name is None:
                continue
            moved = list(args)
            moved[i + 1 + shift] = args[i + 1 + shift].to(where)
            with pytest.raises(RuntimeError, match=f"{name} is on {where}"):
                op(*moved)
    torch.cuda.synchronize()  # nothing reached a kernel


def test_w4a16_fallback_takes_int32_zeros_and_checks_shapes():
    for dtype, g in ((torch.float32, 64), (torch.float16, 24), (torch.bfloat16, 64)):
        q, s, z = rand_int4(72, 192, g, dtype)
        x = rand_x(5, 192, dtype)
        want = ref.w4a16_gemm(x.cpu(), q.cpu(), s.cpu(), z.cpu(), g)
        got = C.w4a16_gemm(x, q, s, z.to(torch.int32), g)
        assert sqnr_db(got, want) > 35
        torch.testing.assert_close(got, C.w4a16_gemm(x, q, s, z, g), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"scales must be \[72, 3\]"):
        C.w4a16_gemm(x, q, s[:, :2], z, 64)
    with pytest.raises(RuntimeError, match=r"zeros must be \[72, 3\]"):
        C.w4a16_gemm(x, q, s, z[:70], 64)


def test_w8a8_rejects_k_past_the_int32_limit():
    x = rand_x(1, 132112, torch.float16)
    with pytest.raises(RuntimeError, match="K=132112 is above 132104"):
        C.w8a8_gemm(x, torch.zeros(16, 132112, dtype=torch.int8, device=DEV), torch.ones(16, device=DEV))


# --- shapes and placements never exercised before -------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [49152, 65536, 132104])
def test_w8a8_outliers_with_long_rows(dtype, k):
    """K past 48 Ki columns with outliers (the quantize kernel's mask is K/8 bytes), up to
    the int32 limit; negative indices name columns from the end as in the reference."""
    q, ws = rand_int8_weight(128, k, seed=k)
    x = rand_x(3, k, dtype)
    idx = torch.tensor([7, k // 2, -1, -5, 40000])
    x[:, idx] *= 30
    w_out = (torch.randn(128, idx.numel()) * 0.05).to(dtype)
    got = C.w8a8_outlier_gemm(x, q, ws, idx.to(DEV), w_out.to(DEV))
    want = ref.w8a8_outlier_gemm(x.cpu(), q.cpu(), ws.cpu(), idx, w_out)
    assert sqnr_db(got, want) > (40 if dtype == torch.float16 else 30)


def test_w8a8_outlier_index_out_of_range_touches_no_memory():
    """The runtime rejects such an index at load (runtime/outlier_columns.py); the op
    itself leaves the column out (gathers 0) without reading or writing outside the row."""
    n, k = 128, 256
    q, ws = rand_int8_weight(n, k)
    x = rand_x(4, k, torch.float16)
    w_out = torch.randn(n, 2, device=DEV, dtype=torch.float16)
    got = C.w8a8_outlier_gemm(x, q, ws, torch.tensor([5, 100000], device=DEV), w_out)
    torch.cuda.synchronize()
    want = ref.w8a8_outlier_gemm(x.cpu(), q.cpu(), ws.cpu(), torch.tensor([5]), w_out[:, :1].cpu())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-2, atol=1e-2)


def test_llm_int8_epilogue_keeps_fp32_outlier_weights():
    """The outlier sum uses the fp32 outlier weights as the reference does: 3 * (1 + 2^-11
    + 2^-13) rounds to 3 + 2^-9 in fp16, while the weight rounded to fp16 first gives 3 + 2^-8."""
    n, k = 128, 64
    x = torch.zeros(1, k, dtype=torch.float16)
    x[0, 10] = 3.0
    w_out = torch.full((n, 1), 1 + 2.0**-11 + 2.0**-13, dtype=torch.float32)
    q, ws = rand_int8_weight(n, k)
    idx = torch.tensor([10])
    want = ref.w8a8_outlier_gemm(x, q.cpu(), ws.cpu(), idx, w_out)
    rounded_first = ref.w8a8_outlier_gemm(x, q.cpu(), ws.cpu(), idx, w_out.half().float())
    assert not torch.equal(want, rounded_first)  # the case tells the two apart
    assert torch.equal(C.w8a8_outlier_gemm(x.to(DEV), q, ws, idx.to(DEV), w_out.to(DEV)).cpu(), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_and_strided_x(dtype):
    """cp.async needs 16-byte aligned rows: an x that starts 2 bytes into its storage, or is
    a transposed view, is copied to an aligned one and gives the same bits."""
    n, k, m, g = 256, 512, 5, 128
    q, s, z = rand_int4(n, k, g, dtype)
    qi, ws = rand_int8_weight(n, k)
    x = rand_x(m, k, dtype)
    shifted = torch.empty(m * k + 1, dtype=dtype, device=DEV)[1:].view(m, k)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 != 0
    strided = x.t().contiguous().t()
    for op, args in ((C.w4a16_gemm, (q, s, z, g)), (C.w8a8_gemm, (qi, ws)),
                     (C.w8a8_outlier_gemm, (qi, ws, torch.tensor([1, 200], device=DEV),
                                            torch.randn(n, 2, device=DEV, dtype=dtype)))):
        want = op(x, *args)
        for other in (shifted, strided):
            assert torch.equal(op(other, *args), want)


def test_non_default_stream():
    """Every op launches on the current stream: results on a side stream equal the default
    stream's (split-K workspaces included: M = 1 splits K)."""
    n, k, g = 4096, 4096, 128
    q, s, z = rand_int4(n, k, g, torch.float16)
    qs, st, zt = C.w4a16_shuffle_for_cuda(q, s, z, g)
    qi, ws = rand_int8_weight(n, k)
    idx, w_out = torch.tensor([3, 999], device=DEV), torch.randn(n, 2, device=DEV, dtype=torch.float16)
    calls = [lambda x: C.w4a16_gemm_shuffled(x, qs, st, zt, g, n), lambda x: C.w4a16_gemm(x, q, s, z, g),
             lambda x: C.w8a8_gemm(x, qi, ws), lambda x: C.w8a8_outlier_gemm(x, qi, ws, idx, w_out),
             lambda x: C.quantize_per_token_int8(x)[0]]
    for m in (1, 100):
        x = rand_x(m, k, torch.float16)
        want = [call(x) for call in calls]
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = [call(x) for call in calls]
        side.synchronize()
        for a, b in zip(got, want):
            assert torch.equal(a, b)


# --- batch invariance of W4A16 (w4a16_tile.cuh: w4_splits) -----------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 11008)])
def test_w4a16_rows_of_decode_batches_equal_rows_alone(dtype, n, k):
    """Up to 64 rows the split-K partition depends on N, K and the GPU only: every row of
    a batch gets the bits it gets alone (the serving engine's batch-invariant greedy output)."""
    g = 128
    q, s, z = rand_int4(n, k, g, dtype)
    qs, st, zt = C.w4a16_shuffle_for_cuda(q, s, z, g)
    x = rand_x(64, k, dtype)
    alone = torch.cat([C.w4a16_gemm_shuffled(x[i:i + 1], qs, st, zt, g, n) for i in range(64)])
    for m in (2, 16, 17, 32, 33, 64):
        assert torch.equal(C.w4a16_gemm_shuffled(x[:m], qs, st, zt, g, n), alone[:m]), f"M={m}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_w4a16_rows_of_large_batches_stay_within_two_ulp(dtype):
    """Past 64 rows the split count falls with M: a row differs from its result alone by
    the fp32 rounding of another partition of its sum, then rounded to the output dtype:
    at most 2 ulp of the output plus 8 fp32 ulps of the sum of |x_k w_k| (the second term
    is what outputs near zero, whose own ulp is tiny, can differ by; a wrong row or column
    would be off by O(1))."""
    n, k, g = 4096, 4096, 128
    q, s, z = rand_int4(n, k, g, dtype)
    qs, st, zt = C.w4a16_shuffle_for_cuda(q, s, z, g)
    x = rand_x(256, k, dtype)
    picked = list(range(0, 256, 51))
    alone = torch.cat([C.w4a16_gemm_shuffled(x[i:i + 1], qs, st, zt, g, n) for i in picked])
    magnitude = x[picked].float().abs() @ ref.dequantize_int4(q, s, z, g, torch.float32).abs().t()
    eps = torch.finfo(dtype).eps
    for m in (65, 130, 256):
        batch = C.w4a16_gemm_shuffled(x[:m], qs, st, zt, g, n)[0:m:51]
        rows = alone[: batch.shape[0]].float()
        bound = 2 * rows.abs() * eps + 8 * torch.finfo(torch.float32).eps * magnitude[: batch.shape[0]]
        excess = ((batch.float() - rows).abs() - bound).max()
        assert excess <= 0, f"M={m}: a row differs from itself alone by {float(excess):.3g} past the bound"


def test_w4a16_fp16_subnormal_scales_error_bound():
    """fp16 activations: the kernel multiplies by the scales in fp16, so a scale below 6.1e-5
    is a subnormal (spacing 2^-24). Stated bound: each dequantized weight is within 2^-20 of
    (u - z) * s with the exact scale; with the scales rounded to fp16 first it is the reference."""
    n, k, g = 256, 512, 128
    qi, s, z = rand_int4(n, k, g, torch.float32)
    s = (torch.rand(n, k // g, generator=torch.Generator().manual_seed(3)) * 5e-5 + 1e-7).to(DEV)
    x = rand_x(4, k, torch.float16)
    got = C.w4a16_gemm(x, qi, s, z, g).float().cpu()  # fp32 scales: the op rounds them to fp16
    as_fp16 = ref.w4a16_gemm(x.cpu(), qi.cpu(), s.half().cpu(), z.cpu(), g).float()
    assert sqnr_db(got, as_fp16) > 45
    exact = x.cpu().float() @ ref.dequantize_int4(qi.cpu(), s.cpu(), z.cpu(), g).t()
    bound = x.cpu().float().abs().sum(1, keepdim=True) * 2.0**-20 + exact.abs() * 2.0**-10
    assert ((got - exact).abs() <= bound).all()


def _paged_case(lens, hq, hkv, d, bs, q_dtype, kv_dtype, seed=3):
    """Rows' blocks from a shuffled pool, -1 past each row's blocks (never read)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 3
    order = torch.randperm(nb, generator=g).tolist()
    tables = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    for r, n in enumerate(need):
        tables[r, :n] = torch.tensor(order[sum(need[:r]):sum(need[:r]) + n], dtype=torch.int32)
    k, v = (kv_int8.to_pool(torch.randn(nb, hkv, bs, d, generator=g), kv_dtype) for _ in range(2))
    q = torch.randn(len(lens), hq, d, generator=g).to(q_dtype)
    return [t.to(DEV) for t in (q, k, v, tables, torch.tensor(lens, dtype=torch.int32))]


@pytest.fixture(params=["split", "heads"])
def paged_kernel(request):
    """Each CUDA paged attention kernel in turn (the split kernel is the default)."""
    before = ops.set_cuda_paged_attention_kernel(request.param)
    yield request.param
    ops.set_cuda_paged_attention_kernel(before)


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("heads,d", [((8, 8), 64), ((32, 8), 128), ((8, 1), 80), ((4, 2), 18), ((12, 1), 256)])
@pytest.mark.parametrize("window", [0, 9, 300])
def test_paged_decode_attention(paged_kernel, q_dtype, kv_dtype, heads, d, window):
    """Lengths around block and split boundaries (256 positions a split), GQA groups of 1,
    2, 4, 8 and 12 (two groups of query heads a block in the split kernel), head dims 18
    (int8 scales unaligned, element loads) to 256 (two columns a thread)."""
    bs = 16
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 256, 257, 700]
    q, k, v, tables, lens = _paged_case(lens, *heads, d, bs, q_dtype, kv_dtype)
    got = C.paged_decode_attention(q, k, v, tables, lens, window)
    want = ref.paged_decode_attention(q.cpu(), k.cpu(), v.cpu(), tables.cpu(), lens.cpu(), window)
    assert got.dtype == q_dtype and got.shape == q.shape
    tol = 1e-5 if q_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
    if paged_kernel == "split" and window != 300:
        torch.library.opcheck(C.paged_decode_attention.default, (q, k, v, tables, lens, window),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_paged_decode_attention_int8_rows_read_as_their_float_values(paged_kernel):
    """int8 pools (a row's values, then its fp32 scale): the kernel reads float(q) * scale,
    so it gives what it gives on the float32 pools of the values read back."""
    q, k, v, tables, lens = _paged_case([1, 15, 16, 17, 53, 700], 8, 2, 64, 16, torch.float32, torch.int8)
    got = C.paged_decode_attention(q, k, v, tables, lens, 0)
    back = C.paged_decode_attention(q, kv_int8.dequantize_rows(k), kv_int8.dequantize_rows(v), tables, lens, 0)
    assert torch.equal(got, back)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.int8])
def test_paged_decode_attention_gives_a_row_its_bits_whatever_its_batch(kv_dtype):
    """The split kernel's splits are fixed lengths of a row's own span: a row alone, in a
    batch, or with a wider table (the CUDA graphs' width) gives the same bits."""
    q, k, v, tables, lens = _paged_case([700, 3, 300, 1500, 40], 8, 2, 128, 16, torch.float16, kv_dtype)
    together = C.paged_decode_attention(q, k, v, tables, lens, 0)
    wide = torch.cat([tables, torch.full((5, 50), -1, dtype=torch.int32, device=DEV)], dim=1).contiguous()
    for r in range(5):
        alone = C.paged_decode_attention(q[r:r + 1], k, v, wide[r:r + 1].contiguous(), lens[r:r + 1], 0)
        assert torch.equal(alone[0], together[r])


def test_paged_decode_attention_on_long_rows(paged_kernel):
    """4,000-position rows (16 splits of the split kernel) against the fp32 reference."""
    q, k, v, tables, lens = _paged_case([4000, 2500, 1], 32, 4, 64, 16, torch.float16, torch.float16)
    want = ref.paged_decode_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), tables.cpu(), lens.cpu(), 0)
    got = C.paged_decode_attention(q, k, v, tables, lens, 0).float().cpu()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def test_paged_decode_attention_checks_arguments():
    q, k, v, tables, lens = _paged_case([5, 9], 4, 2, 64, 8, torch.float16, torch.float16)
    with pytest.raises(RuntimeError, match="block_tables must be int32"):
        C.paged_decode_attention(q, k, v, tables.long(), lens, 0)
    with pytest.raises(RuntimeError, match="k_pool is on cpu but q is on cuda"):
        C.paged_decode_attention(q, k.cpu(), v, tables, lens, 0)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        C.paged_decode_attention(q, k, v, tables, lens, -2)
    rows = kv_int8.quantize_rows(k)
    with pytest.raises(RuntimeError, match=r"k_pool must be 4-D \[num_blocks, n_kv_heads, block_size, head_dim \+ 4"):
        C.paged_decode_attention(q, rows[..., :64], rows[..., :64], tables, lens, 0)
