"""The int8 K / V cache row (compress/ops/kv_int8.py): its layout, its rounding, the
error bound of a read-back value, zero rows, and the cache's element-type choices."""
from __future__ import annotations

import pytest
import torch

from compress.ops import kv_int8
from compress.runtime.kv_cache import PagedKVCache, bytes_per_token, resolve_kv_cache_dtype


def test_a_row_is_its_values_then_its_scale():
    x = torch.tensor([[0.5, -1.27, 0.0, 0.01]])
    rows = kv_int8.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (1, 4 + kv_int8.SCALE_BYTES)
    scale = torch.tensor([1.27]) / 127
    assert torch.equal(kv_int8.row_scales(rows), scale)
    assert rows[0, :4].tolist() == [50, -127, 0, 1]
    assert torch.equal(rows[0, 4:], scale.view(torch.int8))     # the fp32 scale's own bytes


def test_rounding_is_half_to_even_and_read_back_within_half_a_step():
    x = torch.tensor([[127.0, 2.5, -2.5, 3.5, 0.49]])            # scale 1: x / scale exact
    assert kv_int8.quantize_rows(x)[0, :5].tolist() == [127, 2, -2, 4, 0]
    y = torch.randn(64, 8, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 128)
    back = kv_int8.dequantize_rows(kv_int8.quantize_rows(y))
    step = y.abs().amax(-1, keepdim=True) / 127
    assert ((back - y).abs() <= step * 0.5001).all()
    # the largest value comes back as 127 * (amax / 127): within an fp32 rounding or two
    torch.testing.assert_close(back.abs().amax(-1), y.abs().amax(-1), rtol=3e-7, atol=0)


def test_zero_rows_and_other_dtypes():
    z = kv_int8.quantize_rows(torch.zeros(3, 16))
    assert not z.any() and torch.equal(kv_int8.dequantize_rows(z), torch.zeros(3, 16))
    x = torch.randn(5, 32).to(torch.bfloat16)
    assert torch.equal(kv_int8.quantize_rows(x), kv_int8.quantize_rows(x.float()))
    assert kv_int8.dequantize_rows(kv_int8.quantize_rows(x), torch.bfloat16).dtype == torch.bfloat16
    assert kv_int8.to_pool(x, torch.float16).dtype == torch.float16 and kv_int8.row_elems(32, torch.float16) == 32


def test_the_cache_takes_int8_by_name():
    assert resolve_kv_cache_dtype("int8", torch.float32) == torch.int8
    assert resolve_kv_cache_dtype(None, torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="one of float32, bfloat16, float16, int8 .* got 'fp8'"):
        resolve_kv_cache_dtype("fp8", torch.float32)
    cache = PagedKVCache(2, 3, 4, 16, 64, torch.int8)
    assert cache.k.shape == (2, 3, 4, 16, 68) and cache.dtype == torch.int8
    # a quarter of float32's bytes, plus 4 a row
    assert bytes_per_token(2, 4, 64, torch.int8) == 2 * 2 * 4 * 68 == cache.nbytes // (3 * 16)
    assert bytes_per_token(2, 4, 64, torch.float32) == 2 * 2 * 4 * 64 * 4
