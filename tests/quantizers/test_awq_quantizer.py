"""AWQ: scale search, exact folding (norm, linear, GQA v->o), clip search, end to end."""
import pytest
import torch

from compress.architectures import get_arch
from compress.config import ConfigError, from_dict
from quantizers import primitives
from quantizers.awq import AWQConfig, apply_awq
from quantizers.awq_search import (activation_scale, fold_scale_into_linear, fold_scale_into_norm,
                                   kv_head_maps, search_clip, search_scale)
from quantizers.rtn import RTNConfig, apply_rtn
from qhelpers import build_tiny, plant_norm_outliers, rel_err, run_method


def _outlier_inputs(tokens=256, k=256, channels=(3, 70, 200), factor=30.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    x[:, list(channels)] *= factor
    return x


def test_scale_search_reduces_error_vs_rtn():
    x = _outlier_inputs()
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    y = x @ w.t()

    def loss_of(cands):
        return float((x @ cands[0].t() - y).pow(2).mean())

    s, alpha, losses = search_scale(activation_scale(x), [w], loss_of, group_size=128, n_grid=20)
    rtn = float((x @ primitives.fake_quantize_int4(w, 128).t() - y).pow(2).mean())
    assert losses[0] == pytest.approx(rtn)            # alpha = 0 is RTN
    assert min(losses) < 0.5 * rtn and alpha > 0
    assert s[[3, 70, 200]].min() > s.median()          # the outlier channels get the big scales


def test_fold_into_norm_and_linears_keeps_function():
    model = build_tiny("llama", num_hidden_layers=1)
    arch = get_arch("llama")
    block = model.model.layers[0]
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        before = model(ids).logits.clone()
    g = torch.Generator().manual_seed(0)
    hidden, inter = model.config.hidden_size, model.config.intermediate_size
    kv_dim = block.self_attn.v_proj.out_features
    with torch.no_grad():
        for grp in arch.scale_groups:
            prev = block.get_submodule(grp.prev)
            ws = [block.get_submodule(n).weight.data for n in grp.linears]
            if grp.prev_kind == "norm":
                fold_scale_into_norm(prev.weight.data, ws, torch.rand(hidden, generator=g) * 4 + 0.1)
            elif prev.out_features == kv_dim and kv_dim != ws[0].shape[1]:   # v -> o under GQA
                expand, _ = kv_head_maps(4, 2, hidden // 4)
                s = torch.rand(kv_dim, generator=g) * 4 + 0.1
                fold_scale_into_linear(prev.weight.data, None, ws, s, expand(s))
            else:
                s = torch.rand(inter, generator=g) * 4 + 0.1
                fold_scale_into_linear(prev.weight.data, None, ws, s, s)
        after = model(ids).logits
    assert rel_err(after, before) < 1e-5


def test_kv_head_maps_match_repeat_kv():
    expand, reduce = kv_head_maps(num_heads=8, num_kv_heads=2, head_dim=3)
    s = torch.arange(6.0)
    e = expand(s)
    assert e.shape == (24,)
    for h in range(8):                                  # query head h reads kv head h // 4
        assert torch.equal(e[h * 3:(h + 1) * 3], s[(h // 4) * 3:(h // 4 + 1) * 3])
    assert torch.equal(reduce(e), s)


def test_clip_search_never_worse_than_no_clip():
    x = _outlier_inputs(tokens=128, k=128, channels=(), factor=1.0)
    w = torch.randn(32, 128)
    w[:, 5] *= 8                                        # a weight outlier worth clipping
    ratio = search_clip(w, x, 32, n_grid=10)
    assert ratio.shape == (32, 4) and (ratio <= 1).all() and (ratio >= 0.5).all() and (ratio < 1).any()

    def err(r):
        return float((x @ (w - primitives.fake_quantize_int4(w, 32, clip_ratio=r)).t()).pow(2).mean())
    assert err(ratio) <= err(1.0)


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("qwen3", True)])
def test_awq_beats_rtn_on_tiny_model_with_outliers(family, tied):
    model = build_tiny(family, tie_word_embeddings=tied)
    plant_norm_outliers(model, get_arch(family), [5, 40, 99], 20.0)
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    cfg = from_dict(AWQConfig, {"group_size": 64, "n_grid": 10, "clip_grid": 5})
    awq, ctx = run_method(model, family, apply_awq, cfg, ids)
    rtn, _ = run_method(model, family, apply_rtn, RTNConfig(bits=4, group_size=64), ids)
    assert len(awq.quantized) == 14 and {q.scheme for q in awq.quantized.values()} == {"w4a16"}
    with torch.no_grad():
        e_awq, e_rtn = rel_err(awq.model(ids).logits, ref), rel_err(rtn.model(ids).logits, ref)
    assert e_awq < 0.7 * e_rtn, (e_awq, e_rtn)
    assert set(ctx.stats["awq"]["alpha"])              # scales were searched
    if tied:                                            # embeddings untouched, still tied
        assert awq.model.lm_head.weight is awq.model.model.embed_tokens.weight
        assert torch.equal(awq.model.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_awq_bad_inputs():
    where = "r.yaml: stage 'awq-int4' step 1 (awq)"
    with pytest.raises(ConfigError, match="group_size.*multiple of 8"):
        from_dict(AWQConfig, {"group_size": 100}, where)
    with pytest.raises(ConfigError, match="max_shrink"):
        from_dict(AWQConfig, {"max_shrink": 1.5}, where)
    with pytest.raises(ConfigError, match="unknown key 'alpha'"):
        from_dict(AWQConfig, {"alpha": 0.5}, where)
    model = build_tiny("llama")          # hidden 128, intermediate 256
    ids = torch.randint(0, 512, (2, 16))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.*in_features 128.*group_size 256"):
        run_method(model, "llama", apply_awq, AWQConfig(group_size=256), ids)
    with pytest.raises(ConfigError, match="'\\*nothing' matches no linear"):
        run_method(model, "llama", apply_awq, AWQConfig(targets=["*nothing"]), ids)
    with pytest.raises(ConfigError, match="lm_head.*outside"):
        run_method(model, "llama", apply_awq, AWQConfig(targets=["*"]), ids)
