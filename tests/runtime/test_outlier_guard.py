"""The LLM.int8 layer's spike guard: a column outside the calibrated set that reaches
the threshold at run time is computed in float; the native op inside the guard against
the reference op inside it."""
import pytest
import torch

from compress.ops import native_available
from compress.ops.reference import w8a8_outlier_gemm, w8a8_outlier_gemm_guarded
from compress.runtime.layers import Int8OutlierLinear
from compress.accuracy import sqnr_db
from quantizers.primitives import quantize_int8_per_channel


def make_layer(threshold, backend):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * 0.05
    idx = torch.tensor([3, 100])
    q, s = quantize_int8_per_channel(w)
    layer = Int8OutlierLinear(q, s, idx, w[:, idx].clone(), threshold=threshold)
    layer.prepare(backend)
    return layer, w


@pytest.mark.parametrize("backend", ["reference"] + (["native"] if native_available("cpu") else []))
def test_guard_matches_reference_and_rescues_a_spike(backend):
    guarded, w = make_layer(6.0, backend)
    static, _ = make_layer(None, backend)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    x[:, 3] *= 40                     # a calibrated outlier column
    x[2, 77] = 90.0                   # a spike outside the calibrated set
    want = x @ w.t()
    ref = w8a8_outlier_gemm_guarded(x, guarded.qweight, guarded.weight_scale, guarded.outlier_idx,
                                    guarded.outlier_weight, 6.0)
    got = guarded(x)
    assert sqnr_db(ref, got) > 40
    assert sqnr_db(want, got) > sqnr_db(want, static(x)) + 10   # the guard visibly helps
    # no spike: the guard changes nothing
    x[2, 77] = 0.5
    torch.testing.assert_close(guarded(x), static(x))
    # the guarded layer keeps the canonical layout (the guard reads its columns); the
    # static one runs on the CPU kernel's row tiling when native
    assert not guarded.qweight_tiled and static.qweight_tiled == (backend == "native")
    torch.testing.assert_close(static(x), w8a8_outlier_gemm(x, static.canonical_qweight(), static.weight_scale,
                                                            static.outlier_idx, static.outlier_weight),
                               rtol=1e-4, atol=1e-4)
