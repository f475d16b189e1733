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
from compress.ops import reference as ref

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
