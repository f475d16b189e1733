"""The LLM.int8 spike guard inside the native prepared op (w8a8_outlier_gemm_prepared's
``threshold``): a column outside the calibrated outlier set whose |x| reaches the
threshold in any row of the call joins the float path with its dequantized int8 weights,
as reference.w8a8_outlier_gemm_guarded; without a spike the guarded op gives the static
op's bits. On every ISA (decode epilogue, M > 1 tiles, the int16 GEMM on AVX2)."""
from __future__ import annotations

import pytest
import torch

import compress.ops as ops
from compress.ops import reference
from int_weights import make_int8

pytestmark = pytest.mark.skipif(not ops.native_available("cpu"), reason="compress._C not built")
THRESHOLD = 6.0

# (M, N, K, C): decode rows, M past the int16 GEMM's row threshold, K % 64 != 0 (row-major
# weights), many calibrated columns
SHAPES = [(1, 8, 64, 2), (1, 37, 256, 3), (5, 70, 192, 4), (3, 9, 100, 2), (17, 40, 1000, 5), (66, 12, 128, 2),
          (2, 9, 4096, 20)]


def case(m: int, n: int, k: int, c: int, ow_dtype=torch.float32):
    q, s = make_int8(n, k)
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g)
    idx = torch.randperm(k, generator=g)[:c]
    x[:, idx] *= 30.0                         # the calibrated outlier features
    ow = (torch.randn(n, c, generator=g) * 0.05).to(ow_dtype)
    return x, reference.w8a8_tile_cpu(q), s, idx, ow


def spiked(x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """x with spikes in two columns outside idx (one negative, one exactly at the
    threshold: the guard's test is >=) and a huge value in a calibrated column (no spike)."""
    x = x.clone()
    free = [j for j in range(x.shape[1]) if j not in set(idx.tolist())]
    cols = [free[len(free) // 3], free[-1]]
    x[x.shape[0] // 2, cols[0]] = -50.0
    x[-1, cols[1]] = THRESHOLD
    if idx.numel():
        x[0, idx[0]] = 400.0
    return x, cols


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ow_dtype", [torch.float32, torch.float16])
def test_guard_matches_reference(isa, shape, ow_dtype):
    x, tiled, s, idx, ow = case(*shape, ow_dtype)
    x, cols = spiked(x, idx)
    op = torch.ops.compress.w8a8_outlier_gemm_prepared
    got = op(x, tiled, s, idx, ow, THRESHOLD)
    want = reference.w8a8_outlier_gemm_prepared(x, tiled, s, idx, ow, THRESHOLD)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
    # the guard acted: the static op quantizes the spikes with the rest of their rows
    assert (op(x, tiled, s, idx, ow) - want).abs().max() > 1e-3 * scale
    # a threshold above every spike is the static op
    assert torch.equal(op(x, tiled, s, idx, ow, 1000.0), op(x, tiled, s, idx, ow))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_guard_without_spikes_is_the_static_op(isa, shape):
    x, tiled, s, idx, ow = case(*shape)
    x = x.clamp(-5.0, 5.0)
    x[:, idx] *= 30.0   # calibrated columns may exceed the threshold: they are outliers already
    op = torch.ops.compress.w8a8_outlier_gemm_prepared
    assert torch.equal(op(x, tiled, s, idx, ow, THRESHOLD), op(x, tiled, s, idx, ow))


def test_guard_in_bfloat16_and_with_no_calibrated_columns(isa):
    """bf16 activations (converted to fp32 before the test), and an empty static set: the
    spikes are then the only outliers."""
    x, tiled, s, _, _ = case(4, 24, 320, 0)
    empty, no_weights = torch.zeros(0, dtype=torch.long), torch.zeros(24, 0)
    x, _ = spiked(x, empty)
    op = torch.ops.compress.w8a8_outlier_gemm_prepared
    for xx in (x, x.bfloat16()):
        got = op(xx, tiled, s, empty, no_weights, THRESHOLD)
        want = reference.w8a8_outlier_gemm_prepared(xx, tiled, s, empty, no_weights, THRESHOLD)
        tol = 1e-4 if xx.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
