"""Packed layers (w4a16, w8a8, llm_int8) in the runtime against the dequantized dense
model. Weights are quantized here by plain round-to-nearest, independent of the
quantizers package."""
from __future__ import annotations

import pytest
import torch

from compress.architectures import get_arch
from compress.io.schemes import QuantizedWeight
from compress.ops import native_available
from compress.ops.reference import dequantize_int4, pack_int4
from compress.runtime import LLM, SamplingParams
from compress.runtime.layers import DenseLinear, Int4Linear, Int8Linear, Int8OutlierLinear, fuse_linears
from compress.runtime.loading import RuntimeCheckpoint
from compress.runtime.models.llama import build_model

from compress.accuracy import sqnr_db
from runtime_models import hf_model, tiny_config

GROUP = 32


def rtn_int4(w: torch.Tensor, group: int = GROUP) -> tuple[QuantizedWeight, torch.Tensor]:
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    zero = (-lo / scale).round().clamp(0, 15)
    u = ((g / scale.unsqueeze(-1)).round() + zero.unsqueeze(-1)).clamp(0, 15).to(torch.uint8).view(n, k)
    qw = QuantizedWeight("w4a16", {"qweight": pack_int4(u), "scales": scale, "zeros": zero.to(torch.uint8)},
                         {"group_size": group, "in_features": k})
    return qw, dequantize_int4(qw.tensors["qweight"], scale, qw.tensors["zeros"], group)


def rtn_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(1).clamp_min(1e-8) / 127
    return (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def quantize(w: torch.Tensor, scheme: str) -> tuple[QuantizedWeight, torch.Tensor]:
    """(packed weight, the dense weight it stands for)."""
    if scheme == "w4a16":
        return rtn_int4(w)
    if scheme == "w4a16-channel":   # one scale per output row, any K (the quantizer's own core)
        from quantizers.rtn import RTNConfig, quantize_weight_rtn

        qw = quantize_weight_rtn(w, RTNConfig(group_size="channel"), "test")
        return qw, qw.dequantize()
    if scheme == "w8a8":
        q, s = rtn_int8(w)
        return QuantizedWeight("w8a8", {"qweight": q, "weight_scale": s}), q.float() * s[:, None]
    idx = torch.tensor([3, 17])
    rest = w.clone()
    rest[:, idx] = 0
    q, s = rtn_int8(rest)
    dense = q.float() * s[:, None]
    dense[:, idx] = w[:, idx]
    return QuantizedWeight("llm_int8", {"qweight": q, "weight_scale": s, "outlier_idx": idx,
                                        "outlier_weight": w[:, idx].clone()}, {"threshold": 6.0}), dense


def quantized_pair(family: str, scheme: str, vocab: int, **overrides):
    """(checkpoint with every block linear packed, HF model holding the dequantized weights);
    ``overrides`` change the tiny config (e.g. ``intermediate_size=172``)."""
    config = tiny_config(family, vocab, **overrides)
    model = hf_model(config)
    arch = get_arch(config.model_type)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    quantized = {}
    for i in range(config.num_hidden_layers):
        for name in arch.block_linears:
            path = f"{arch.block_prefix(i)}.{name}"
            qw, deq = quantize(state.pop(path + ".weight"), scheme)
            quantized[path] = qw
            model.get_submodule(path).weight.data.copy_(deq)
    return RuntimeCheckpoint(config, state, quantized), model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("scheme", ["w4a16", "w8a8", "llm_int8"])
def test_quantized_logits_match_dequantized_reference(tokenizer, family, scheme):
    ckpt, ref = quantized_pair(family, scheme, len(tokenizer))
    ids = torch.randint(2, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits
    llm = LLM.from_checkpoint(ckpt, tokenizer, kernels="reference")
    layer_cls = {"w4a16": Int4Linear, "w8a8": Int8Linear, "llm_int8": Int8OutlierLinear}[scheme]
    assert isinstance(llm.model.layers[0].mlp.down_proj, layer_cls)
    got = llm.logits(ids)
    if scheme == "w4a16":   # weight-only: exact up to float rounding
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    else:                   # int8 activations add their own (small) error
        assert sqnr_db(expected, got) > 25
    if native_available("cpu"):
        native = LLM.from_checkpoint(ckpt, tokenizer, kernels="native").logits(ids)
        # the native int4 kernel quantizes activations to int8 in blocks of 32 (as llama.cpp
        # does): ~45 dB per op, ~30 dB through a random model's logits
        assert sqnr_db(got, native) > (25 if scheme == "w4a16" else 40)


def test_quantized_generation_uses_cache_consistently(tokenizer):
    ckpt, _ = quantized_pair("llama", "w4a16", len(tokenizer))
    llm = LLM.from_checkpoint(ckpt, tokenizer, kernels="reference")
    out = llm.generate(["Hello world", "def"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for o in out:
        ids = list(o.prompt_token_ids)
        for tok in o.token_ids:
            assert int(llm.logits(torch.tensor([ids]))[0, -1].argmax()) == tok
            ids.append(tok)


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8", "llm_int8"])
def test_exported_checkpoint_runs_like_in_memory(tmp_path, tokenizer, scheme):
    """export_checkpoint -> LLM(path): the on-disk round trip changes nothing."""
    from compress.io.export import export_checkpoint
    ckpt, _ = quantized_pair("llama", scheme, len(tokenizer))
    out = export_checkpoint(tmp_path / scheme, ckpt.config, ckpt.dense, ckpt.quantized, tokenizer=tokenizer)
    ids = torch.randint(2, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(0))
    loaded = LLM(out, kernels="reference")
    assert loaded.manifest is not None
    assert type(loaded.model.layers[1].attn.qkv_proj) is type(
        LLM.from_checkpoint(ckpt, tokenizer).model.layers[1].attn.qkv_proj)
    torch.testing.assert_close(loaded.logits(ids), LLM.from_checkpoint(ckpt, tokenizer, kernels="reference").logits(ids),
                               atol=1e-5, rtol=1e-5)
    assert loaded.generate("Hello", SamplingParams(max_tokens=3, temperature=0))[0].token_ids


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("scheme", ["dense", "w4a16", "w8a8", "llm_int8"])
@pytest.mark.parametrize("kernels", ["reference", "native"])
def test_fused_projections_compute_the_same_logits(tokenizer, family, scheme, kernels):
    """q/k/v and gate/up fused into one linear each (load time) give the logits of the
    separate layers: each output row is computed the same way (qwen2 adds q/k/v biases)."""
    if kernels == "native" and not native_available("cpu"):
        pytest.skip("native CPU kernels not built")
    if scheme == "dense":
        model = hf_model(tiny_config(family, len(tokenizer)))
        ckpt = RuntimeCheckpoint(model.config, {k: v.clone() for k, v in model.state_dict().items()}, {})
    else:
        ckpt, _ = quantized_pair(family, scheme, len(tokenizer))
    fused = build_model(ckpt, kernels=kernels)
    plain = build_model(ckpt, kernels=kernels, fuse=False)
    assert fused.layers[0].attn.qkv_proj is not None and fused.layers[0].mlp.gate_up_proj is not None
    assert plain.layers[0].attn.qkv_proj is None and plain.layers[0].mlp.gate_up_proj is None
    ids = torch.randint(2, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12).expand(2, 12)
    with torch.inference_mode():
        got, want = fused.logits(fused(ids, pos)), plain.logits(plain(ids, pos))
    tol = 1e-5 if scheme == "dense" else 0.0
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_fuse_linears_refuses_layers_that_cannot_share_a_call():
    w = torch.randn(64, 64)
    q4, _ = rtn_int4(w)
    a = Int4Linear(**q4.tensors, group_size=GROUP, in_features=64)
    b = Int4Linear(**rtn_int4(w, group=64)[0].tensors, group_size=64, in_features=64)
    q8, s8 = rtn_int8(w)
    assert fuse_linears([a, b]) is None                      # group sizes differ
    assert fuse_linears([a, Int8Linear(q8, s8)]) is None     # schemes differ
    assert fuse_linears([a, DenseLinear(torch.randn(64, 32))]) is None  # input sizes differ
    idx = torch.tensor([1, 2])
    o1 = Int8OutlierLinear(q8, s8, idx, w[:, idx].clone())
    o2 = Int8OutlierLinear(q8, s8, torch.tensor([1, 3]), w[:, idx].clone())
    assert fuse_linears([o1, o2]) is None                    # outlier columns differ
    both = fuse_linears([a, a])
    assert both.out_features == 128 and both.group_size == GROUP


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
@pytest.mark.parametrize("lanes", [False, True], ids=["row-tiled", "lanes"])
def test_int4_linear_tiles_for_the_cpu_kernel_and_restores_the_canonical_layout(lanes, monkeypatch):
    """prepare("native") replaces qweight by the CPU kernel's layout (row tiling, or the
    lanes layout where the CPU takes it; no second copy); preparing for the reference
    restores the canonical tensors, and both compute the same."""
    from compress.runtime import layers
    monkeypatch.setattr(layers, "INT4_LANES", lanes)
    if lanes and not layers.int4_lanes_wanted():
        pytest.skip("the lanes layout is prepared on AVX-512 VNNI CPUs without AMX only")
    w = torch.randn(70, 128)
    q4, _ = rtn_int4(w, group=64)
    canonical = q4.tensors["qweight"].clone()
    scales, zeros = q4.tensors["scales"].float().clone(), q4.tensors["zeros"].clone()
    layer = Int4Linear(**q4.tensors, group_size=64, in_features=128)
    x = torch.randn(3, 128)
    layer.prepare("native")
    assert (layer.lanes_scales is not None) == lanes and layer.qweight_tiled != lanes
    assert not torch.equal(layer.qweight, canonical)
    native = layer(x)
    fused = fuse_linears([layer, layer])  # fusing a prepared layer concatenates canonical rows
    fused.prepare("reference")
    torch.testing.assert_close(fused.qweight, torch.cat([canonical, canonical]), rtol=0, atol=0)
    layer.prepare("reference")
    assert not layer.qweight_tiled and layer.lanes_scales is None
    torch.testing.assert_close(layer.qweight, canonical, rtol=0, atol=0)
    assert torch.equal(layer.scales.float(), scales) and torch.equal(layer.zeros, zeros)
    reference = layer(x)
    assert sqnr_db(reference, native) > 35
    torch.testing.assert_close(fused(x), torch.cat([reference, reference], -1), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
@pytest.mark.parametrize("lanes", [False, True], ids=["row-tiled", "lanes"])
def test_int8_linear_takes_the_lanes_layout_and_restores_the_canonical_one(lanes, monkeypatch):
    """prepare("native") puts a W8A8 layer's weights in the lanes layout where the CPU takes
    it (AVX-512 VNNI without AMX; decode_spec 'w8a8_lanes'), else row-tiles them; both give
    the row-tiled kernels' bits; preparing for the reference restores the canonical tensors,
    and fusing a prepared layer concatenates canonical rows."""
    from compress.runtime import layers
    monkeypatch.setattr(layers, "INT8_LANES", lanes)
    if lanes and not layers.int8_lanes_wanted(96):
        pytest.skip("the W8A8 lanes layout is prepared on AVX-512 VNNI CPUs without AMX only")
    w = torch.randn(70, 96)
    q8, s8 = rtn_int8(w)
    layer = Int8Linear(q8.clone(), s8.clone())
    x = torch.randn(5, 96)
    layer.prepare("native")
    assert (layer.lanes is not None) == lanes and layer.qweight_tiled != lanes
    assert layer.decode_spec()[0] == ("w8a8_lanes" if lanes else "w8a8_prepared")
    assert torch.equal(layer.canonical_qweight(), q8)
    native = layer(x)
    assert torch.equal(native, torch.ops.compress.w8a8_gemm_prepared(x, reference_tile(q8), s8))
    fused = fuse_linears([layer, layer])
    fused.prepare("reference")
    assert torch.equal(fused.qweight, torch.cat([q8, q8]))
    layer.prepare("reference")
    assert layer.lanes is None and not layer.qweight_tiled and torch.equal(layer.qweight, q8)
    assert sqnr_db(layer(x), native) > 60
    layer.prepare("native")   # and back
    assert torch.equal(layer(x), native)


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
def test_int8_linear_prepared_again_after_the_switch_starts_from_canonical_weights(monkeypatch):
    """A layer prepared row-tiled, then prepared again with the lanes layout wanted (or the
    other way), lays out its canonical weights, not the previous layout's bytes."""
    from compress.runtime import layers
    if not layers.int8_lanes_wanted(128):
        pytest.skip("the W8A8 lanes layout is prepared on AVX-512 VNNI CPUs without AMX only")
    q8, s8 = rtn_int8(torch.randn(70, 128))  # K % 64 == 0: row tiling moves bytes
    layer = Int8Linear(q8.clone(), s8.clone())
    x = torch.randn(5, 128)
    want = torch.ops.compress.w8a8_gemm_prepared(x, reference_tile(q8), s8)
    for lanes in (False, True, False):
        monkeypatch.setattr(layers, "INT8_LANES", lanes)
        layer.prepare("native")
        assert (layer.lanes is not None) == lanes
        assert torch.equal(layer.canonical_qweight(), q8) and torch.equal(layer(x), want)


def reference_tile(q8):
    from compress.ops.reference import w8a8_tile_cpu
    return w8a8_tile_cpu(q8)
