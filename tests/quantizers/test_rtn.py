"""Round-to-nearest baselines, the primitives under them and target selection."""
import pytest
import torch

from compress.accuracy import sqnr_db
from compress.config import ConfigError, from_dict
from compress.ops import reference as ref
from quantizers import primitives
from quantizers.rtn import RTNConfig, apply_rtn, quantize_weight_rtn
from quantizers.targets import select_linears
from qhelpers import build_tiny, rel_err, run_method


def test_int4_pack_roundtrip():
    u = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(ref.unpack_int4(ref.pack_int4(u)), u)


def test_int8_per_channel_roundtrip_and_sqnr():
    w = torch.randn(64, 128)
    q, s = primitives.quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (64,)
    assert q.abs().max() <= 127
    assert sqnr_db(w, primitives.dequantize_int8_per_channel(q, s)) > 38


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_groupwise_matches_fake_quant(group_size, symmetric):
    w = torch.randn(48, 256)
    qw, scales, zeros = primitives.quantize_int4_groupwise(w, group_size, symmetric)
    assert qw.shape == (48, 256 // 8) and scales.shape == zeros.shape == (48, 256 // group_size)
    deq = ref.dequantize_int4(qw, scales, zeros, group_size)
    assert torch.allclose(deq, primitives.fake_quantize_int4(w, group_size, symmetric), atol=1e-6)
    assert sqnr_db(w, deq) > 17
    if symmetric:
        assert (zeros == 8).all()


def test_int4_clip_ratio_shrinks_range():
    w = torch.randn(8, 128)
    s1, _ = primitives.int4_group_params(w, 128, clip_ratio=1.0)
    s2, _ = primitives.int4_group_params(w, 128, clip_ratio=torch.full((8, 1), 0.5))
    assert torch.allclose(s2, s1 * 0.5, rtol=1e-5)


def test_check_group_size_and_finite():
    with pytest.raises(ValueError, match="layer 'x.q'.*not divisible"):
        primitives.check_group_size(96, 64, "x.q")
    with pytest.raises(ValueError, match="multiple of 8"):
        primitives.check_group_size(96, 12, "x.q")
    w = torch.randn(4, 8)
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        primitives.check_finite(w, "x.q")


def test_rtn_core_schemes():
    w = torch.randn(32, 128)
    q8 = quantize_weight_rtn(w, RTNConfig(bits=8), "l")
    assert q8.scheme == "w8a8" and q8.tensors["qweight"].dtype == torch.int8
    q4 = quantize_weight_rtn(w, RTNConfig(bits=4, group_size=64), "l")
    assert q4.scheme == "w4a16" and q4.meta["group_size"] == 64


def test_rtn_on_tiny_model_records_every_block_linear():
    model = build_tiny("llama")
    ids = torch.randint(0, 512, (2, 16))
    state, _ = run_method(model, "llama", apply_rtn, RTNConfig(bits=4, group_size=32), ids)
    assert len(state.quantized) == 2 * 7 and "lm_head" not in state.quantized
    with torch.no_grad():
        assert rel_err(state.model(ids).logits, model(ids).logits) < 0.2


def test_rtn_config_validation():
    with pytest.raises(ConfigError, match="group_size"):
        from_dict(RTNConfig, {"group_size": 12}, "r.yaml: step 1 (rtn)")
    with pytest.raises(ConfigError, match="bits"):
        from_dict(RTNConfig, {"bits": 3}, "r.yaml: step 1 (rtn)")


def test_select_linears_patterns():
    model = build_tiny("llama")
    chosen = select_linears(model, ["*q_proj", "re:.*layers\\.1\\.mlp\\..*"], ["model.layers.0.*"])
    names = [n for n, _ in chosen]
    assert names == ["model.layers.1.self_attn.q_proj", "model.layers.1.mlp.gate_proj",
                     "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"]
    with pytest.raises(ConfigError, match="'\\*qproj' matches no linear"):
        select_linears(model, ["*qproj"], [], "r.yaml: step 1")
    with pytest.raises(ConfigError, match="select no layer"):
        select_linears(model, ["*q_proj"], ["*proj"], "r.yaml: step 1")
