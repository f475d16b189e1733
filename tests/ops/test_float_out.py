"""The GEMM ops' low-precision outputs (csrc/cpu/float_out.cpp): with bf16 or fp16
activations each op returns exactly its fp32 result rounded by torch's ``.to(dtype)``,
on every ISA, on each path (W4 float tiles and at::mm, W4 int8 tiles, AMX, dequantize
fallback; W8; fused LLM.int8, with and without spike columns)."""
from __future__ import annotations

import pytest
import torch

import compress.ops as ops
from compress.ops import reference
from int_weights import make_int4, make_int8

pytestmark = pytest.mark.skipif(not ops.native_available("cpu"), reason="compress._C not built")


def _gemms(n: int, k: int):
    qweight, scales, zeros = make_int4(n, k, 32)
    q16, s16, z16 = make_int4(n, k, 16)
    prepared = reference.w4a16_prepare_cpu(qweight, scales, zeros)
    q8, ws = make_int8(n, k)
    q8t = reference.w8a8_tile_cpu(q8)
    q8l = reference.w8a8_prepare_lanes(q8, ws)
    idx, ow = torch.tensor([0, 5, k - 1]), torch.randn(n, 3)
    c = torch.ops.compress
    return {
        "w4a16": lambda x: c.w4a16_gemm(x, qweight, scales, zeros, 32),
        "w4a16_prepared": lambda x: c.w4a16_gemm_prepared(x, *prepared, 32),
        "w4a16_group16": lambda x: c.w4a16_gemm(x, q16, s16, z16, 16),  # K-order dequantize path
        "w4a8": lambda x: c.w4a8_gemm(x, qweight, scales, zeros, 32),
        "w4a8_prepared": lambda x: c.w4a8_gemm_prepared(x, *prepared, 32),
        "w8a8": lambda x: c.w8a8_gemm(x, q8, ws),
        "w8a8_prepared": lambda x: c.w8a8_gemm_prepared(x, q8t, ws),
        "w8a8_lanes": lambda x: c.w8a8_gemm_lanes(x, *q8l, n),
        "w8a8_outlier": lambda x: c.w8a8_outlier_gemm_prepared(x, q8t, ws, idx, ow),
        "w8a8_outlier_guarded": lambda x: c.w8a8_outlier_gemm_prepared(x, q8t, ws, idx, ow, 2.0),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n", [(1, 37), (5, 300), (40, 45)], ids=["decode", "odd", "amx_rows"])
def test_low_precision_outputs_round_like_torch(isa, dtype, m, n):
    k = 128
    x = torch.randn(m, k)
    if dtype == torch.bfloat16:  # outputs past fp32 / bf16 range (inf) and a NaN row
        x[0] *= 1e36
        x[-1, 3] = float("nan")
    x = x.to(dtype)
    for name, gemm in _gemms(n, k).items():
        low, full = gemm(x), gemm(x.float())
        assert low.dtype == dtype and full.dtype == torch.float32, name
        torch.testing.assert_close(low, full.to(dtype), rtol=0, atol=0, equal_nan=True, msg=name)
