"""The LLM.int8 layer's spike guard: a column outside the calibrated set that reaches
the threshold at run time is computed in float; natively inside the prepared op (the
layer keeps the CPU kernel's row tiling and its decode_layer form), against the
reference guard."""
import pytest
import torch

from compress.ops import native_available
from compress.ops.reference import w8a8_outlier_gemm, w8a8_outlier_gemm_guarded
from compress.runtime.layers import Int8OutlierLinear
from compress.runtime.models.llama import build_model
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
    ref = w8a8_outlier_gemm_guarded(x, guarded.canonical_qweight(), guarded.weight_scale, guarded.outlier_idx,
                                    guarded.outlier_weight, 6.0)
    got = guarded(x)
    assert sqnr_db(ref, got) > 40
    assert sqnr_db(want, got) > sqnr_db(want, static(x)) + 10   # the guard visibly helps
    # no spike: the guard changes nothing
    x[2, 77] = 0.5
    torch.testing.assert_close(guarded(x), static(x))
    # both run on the CPU kernel's row tiling when native (the guard is in the op), and
    # both have a decode_layer form there, the guarded one with its threshold
    assert guarded.qweight_tiled == static.qweight_tiled == (backend == "native")
    spec = guarded.decode_spec()
    if backend == "native":
        assert spec[0] == "llm_int8_guarded_prepared" and float(spec[2][4]) == 6.0
        assert static.decode_spec()[0] == "llm_int8_prepared"
    else:
        assert spec is None
    torch.testing.assert_close(static(x), w8a8_outlier_gemm(x, static.canonical_qweight(), static.weight_scale,
                                                            static.outlier_idx, static.outlier_weight),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
def test_guarded_model_follows_the_reference(tokenizer):
    """An LLM.int8 model with the guard in the native op keeps a form the native decode
    step takes (its decode_spec); its logits over engine steps, with spikes in every
    step, follow the reference kernels (the guard in Python around the reference op)."""
    from paged_steps import step_logits
    from scheme_checkpoints import checkpoint

    ckpt = checkpoint("llama", "llm_int8_guarded", len(tokenizer))
    native = build_model(ckpt)
    assert {m.decode_spec()[0] for layer in native.layers for m in (layer.attn.qkv_proj, layer.mlp.down_proj)} \
        == {"llm_int8_guarded_prepared"}
    prompts = [[5, 9, 13, 21, 8, 40, 3], [11, 4, 7]]
    got = step_logits(native, prompts, 6)
    want = step_logits(build_model(ckpt, kernels="reference"), prompts, 6)
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    static = step_logits(build_model(checkpoint("llama", "llm_int8", len(tokenizer))), prompts, 6)
    assert all((g - s).abs().max() > 1e-3 for g, s in zip(got, static))   # the guard acted in every step
