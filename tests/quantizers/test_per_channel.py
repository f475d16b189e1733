"""Per-channel int4 (one scale and zero point per output row over the whole K): the
recipe spellings, the quantization core for any K (172 included), RTN and AWQ."""
import pytest
import torch

from compress.accuracy import sqnr_db
from compress.config import ConfigError, from_dict
from compress.ops import reference as ref
from quantizers import primitives
from quantizers.awq import AWQConfig, apply_awq
from quantizers.rtn import RTNConfig, apply_rtn, quantize_weight_rtn
from qhelpers import build_tiny, rel_err, run_method

WHERE = "r.yaml: step 1"


@pytest.mark.parametrize("config_class", [RTNConfig, AWQConfig])
@pytest.mark.parametrize("spelling", ["channel", -1])
def test_per_channel_spellings_are_accepted(config_class, spelling):
    cfg = from_dict(config_class, {"group_size": spelling}, WHERE)
    assert primitives.is_per_channel(cfg.group_size)
    assert primitives.resolve_group_size(cfg.group_size, 172) == 172


@pytest.mark.parametrize("config_class", [RTNConfig, AWQConfig])
@pytest.mark.parametrize("bad", ["chanel", -2, 0, 12, 1.5])
def test_bad_group_size_names_the_key(config_class, bad):
    with pytest.raises(ConfigError, match=r"r\.yaml: step 1\.group_size") as info:
        from_dict(config_class, {"group_size": bad}, WHERE)
    if not isinstance(bad, float):
        assert "'channel' or -1" in str(info.value)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k", [172, 96, 256])
def test_per_channel_core_any_k(k, symmetric):
    w = torch.randn(40, k)
    qw, scales, zeros = primitives.quantize_int4_groupwise(w, k, symmetric)
    assert qw.shape == (40, -(-k // 8)) and scales.shape == zeros.shape == (40, 1)
    codes = ref.unpack_int4(qw)
    assert (codes[:, k:] == 0).all()   # the padding nibbles, as compressed-tensors writes them
    deq = (codes[:, :k].float() - zeros.float()) * scales
    torch.testing.assert_close(deq, primitives.fake_quantize_int4(w, k, symmetric), atol=1e-6, rtol=0)
    # one scale per row: the row's own range
    if symmetric:
        torch.testing.assert_close(scales[:, 0], w.abs().amax(1) / 7)
    else:
        torch.testing.assert_close(scales[:, 0], (w.amax(1).clamp_min(0) - w.amin(1).clamp_max(0)) / 15)
    assert sqnr_db(w, deq) > 15


def test_rtn_per_channel_weight_and_meta():
    w = torch.randn(24, 172)
    q = quantize_weight_rtn(w, from_dict(RTNConfig, {"group_size": "channel"}), "l")
    assert q.scheme == "w4a16" and q.tensors["scales"].shape == (24, 1)
    assert q.meta == {"group_size": 172, "in_features": 172, "symmetric": False, "strategy": "channel"}
    assert q.dequantize().shape == (24, 172)
    torch.testing.assert_close(q.dequantize(), primitives.fake_quantize_int4(w, 172), atol=1e-6, rtol=0)
    # groupwise records no strategy (exported as compressed-tensors' group strategy)
    assert "strategy" not in quantize_weight_rtn(torch.randn(24, 128), RTNConfig(group_size=64), "l").meta


def test_indivisible_group_size_suggests_per_channel():
    with pytest.raises(ValueError, match=r"layer 'x\.down': in_features 172 is not divisible by group_size 128; "
                                         r"use group_size: channel"):
        primitives.check_group_size(172, 128, "x.down")
    primitives.check_group_size(172, "channel", "x.down")
    primitives.check_group_size(172, -1, "x.down")


def test_rtn_per_channel_on_model_with_mlp_172():
    model = build_tiny("llama", intermediate_size=172)
    ids = torch.randint(0, 512, (2, 16))
    state, _ = run_method(model, "llama", apply_rtn, RTNConfig(group_size="channel"), ids)
    down = state.quantized["model.layers.0.mlp.down_proj"]
    assert down.meta["in_features"] == 172 and down.tensors["qweight"].shape == (128, 22)
    assert len(state.quantized) == 2 * 7
    with torch.no_grad():
        assert rel_err(state.model(ids).logits, model(ids).logits) < 0.2


def test_awq_per_channel_on_model_with_mlp_172():
    """AWQ's scale and clip searches run with one group per row, and beat per-channel RTN
    on the calibration objective (the search includes alpha = 0, which is RTN)."""
    model = build_tiny("llama", intermediate_size=172)
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    cfg = from_dict(AWQConfig, {"group_size": -1, "n_grid": 5, "clip_grid": 4})
    state, ctx = run_method(model, "llama", apply_awq, cfg, ids)
    down = state.quantized["model.layers.1.mlp.down_proj"]
    assert down.meta["strategy"] == "channel" and down.tensors["scales"].shape == (128, 1)
    assert all(g >= 1.0 for g in ctx.stats["awq"]["gain"])
    rtn, _ = run_method(model, "llama", apply_rtn, RTNConfig(group_size="channel"), ids)
    with torch.no_grad():
        ref_logits = model(ids).logits
        assert rel_err(state.model(ids).logits, ref_logits) <= 1.05 * rel_err(rtn.model(ids).logits, ref_logits)
