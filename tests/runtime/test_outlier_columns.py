"""LLM.int8() outlier indices checked at load time (runtime/outlier_columns.py): negative
ones name columns from the end, as the reference reads them; out-of-range ones are an
error naming the layer's shape (the CUDA kernel would leave such a column out)."""
import pytest
import torch

from compress.errors import UserError
from compress.ops import native_available
from compress.ops.reference import w8a8_outlier_gemm
from compress.runtime.layers import Int8OutlierLinear
from compress.runtime.outlier_columns import OutlierIndexError
from quantizers.primitives import quantize_int8_per_channel

BACKENDS = ["reference"] + (["native"] if native_available("cpu") else [])


def make_layer(idx, backend):
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    q, s = quantize_int8_per_channel(w)
    idx_in = idx.clamp(-96, 95) if idx.dtype == torch.long else torch.zeros(idx.numel(), dtype=torch.long)
    layer = Int8OutlierLinear(q, s, idx, w[:, idx_in].clone())
    layer.prepare(backend)
    return layer


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_outlier_indices_wrap_like_the_reference(backend):
    idx = torch.tensor([-1, 3, -96])
    layer = make_layer(idx, backend)
    assert layer.outlier_idx.tolist() == [95, 3, 0] and layer.outlier_idx.dtype == torch.long
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(1))
    x[:, [95, 3, 0]] *= 30
    want = w8a8_outlier_gemm(x, layer.canonical_qweight(), layer.weight_scale, idx, layer.outlier_weight)
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", [[3, 96], [-97], [1000, 2, -500]])
def test_out_of_range_outlier_indices_fail_at_load(bad):
    with pytest.raises(OutlierIndexError, match=r"\[N=32, K=96\].*outside \[-96, 96\)") as info:
        make_layer(torch.tensor(bad), "reference")
    assert isinstance(info.value, UserError)
    assert str([b for b in bad if not -96 <= b < 96]) in str(info.value)


def test_outlier_indices_must_be_integers():
    with pytest.raises(OutlierIndexError, match="1-D integer tensor"):
        make_layer(torch.tensor([3.0]), "reference")
