"""Per-channel int4 in the runtime: the same int4 kernels, with a K they cannot take
(172) padded at load time (``runtime/int4_padding.py``) so that the padding contributes
exactly 0; fused q/k/v and gate/up; the native decode step's form where K needs no padding and
the module path where it does."""
from __future__ import annotations

import pytest
import torch

from compress.accuracy import sqnr_db
from compress.ops import native_available
from compress.ops.reference import unpack_int4
from compress.runtime import LLM
from compress.runtime.layers import Int4Linear, fuse_linears
from compress.runtime.models.llama import build_model
from quantizers.rtn import RTNConfig, quantize_weight_rtn

from test_quantized import quantized_pair

BACKENDS = ["reference"] + (["native"] if native_available("cpu") else [])


def per_channel(w: torch.Tensor, symmetric: bool = False):
    return quantize_weight_rtn(w, RTNConfig(group_size="channel", symmetric=symmetric), "test")


def int4_layer(qw, backend: str) -> Int4Linear:
    layer = Int4Linear(**qw.tensors, group_size=qw.meta["group_size"], in_features=qw.meta["in_features"])
    layer.prepare(backend)
    return layer


def check_output(layer: Int4Linear, x: torch.Tensor, want: torch.Tensor, backend: str) -> None:
    got = layer(x)
    if backend == "reference":
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # bounds that also hold for the int8-activation path (w4_activations='int8')
        assert sqnr_db(want, got) > 38


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k, k_padded", [(172, 192), (96, 128), (256, 256)])
def test_layer_matches_dequantized_matmul(backend, symmetric, k, k_padded):
    torch.manual_seed(k)
    qw = per_channel(torch.randn(40, k), symmetric)
    layer = int4_layer(qw, backend)
    assert layer.in_features == k and layer.k_padded == layer.group_size == k_padded
    codes = unpack_int4(layer.canonical_qweight())
    assert codes.shape == (40, k_padded)
    # padded codes are the row's zero point: those weights dequantize to exactly 0
    assert torch.equal(codes[:, k:], layer.zeros.expand(-1, k_padded - k))
    assert torch.equal(codes[:, :k], unpack_int4(qw.tensors["qweight"])[:, :k])
    x = torch.randn(5, k)
    check_output(layer, x, x @ qw.dequantize().t(), backend)
    check_output(layer, x[:1], x[:1] @ qw.dequantize().t(), backend)   # M = 1 (decode)
    if backend == "native":
        assert layer.qweight_tiled or layer.lanes_scales is not None        # the native kernels, not a fallback
        assert (layer.decode_spec() is None) is (k != k_padded)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_padded_layers(backend):
    torch.manual_seed(1)
    qws = [per_channel(torch.randn(n, 172)) for n in (24, 8, 8)]
    fused = fuse_linears([Int4Linear(**q.tensors, group_size=172, in_features=172) for q in qws])
    fused.prepare(backend)
    assert fused.in_features == 172 and fused.k_padded == fused.group_size == 192 and fused.out_features == 40
    x = torch.randn(3, 172)
    check_output(fused, x, x @ torch.cat([q.dequantize() for q in qws]).t(), backend)


@pytest.mark.parametrize("intermediate", [172, 128])
def test_tiny_llama_matches_dequantized_reference(tokenizer, intermediate):
    ckpt, ref = quantized_pair("llama", "w4a16-channel", len(tokenizer), intermediate_size=intermediate)
    ids = torch.randint(2, len(tokenizer), (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits
    got = LLM.from_checkpoint(ckpt, tokenizer, kernels="reference").logits(ids)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    if native_available("cpu"):
        native = LLM.from_checkpoint(ckpt, tokenizer, kernels="native")
        assert sqnr_db(expected, native.logits(ids)) > 25   # a bound the int8-activation path meets too
        down = native.model.layers[0].mlp.down_proj
        assert down.k_padded == (192 if intermediate == 172 else 128)


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
@pytest.mark.parametrize("intermediate", [172, 128])
def test_engine_steps_and_the_native_form_where_k_allows(tokenizer, intermediate):
    """Engine steps (prefill, then decodes over the paged cache) follow the reference
    kernels; a layer whose K is padded has no form for the native decode step (which
    passes x unpadded), one whose K needs no padding has."""
    from paged_steps import step_logits

    ckpt, _ = quantized_pair("llama", "w4a16-channel", len(tokenizer), intermediate_size=intermediate)
    model = build_model(ckpt)
    assert model.layers[0].attn.qkv_proj is not None and model.layers[0].mlp.gate_up_proj is not None
    assert (model.layers[0].mlp.down_proj.decode_spec() is None) == (intermediate == 172)
    prompts = [[5, 9, 13, 21, 8, 40, 3], [11, 4, 7]]
    reference = build_model(ckpt, kernels="reference")
    for got, want in zip(step_logits(model, prompts, 5), step_logits(reference, prompts, 5)):
        assert sqnr_db(want, got) > 25


@pytest.mark.parametrize("k, group_size", [(64, 32), (96, 32), (160, 32)])
def test_groupwise_layers_are_not_padded(k, group_size):
    qw = quantize_weight_rtn(torch.randn(16, k), RTNConfig(group_size=group_size), "test")
    layer = int4_layer(qw, "reference")
    assert layer.group_size == group_size and layer.k_padded == k
    assert torch.equal(layer.qweight, qw.tensors["qweight"])
