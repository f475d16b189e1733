"""A decode step as one ``compress._C.DecodePlan`` call against one ``compress::decode_layer``
op call per layer: the same C++ layer function, so the logits must be bit-identical, for
every scheme, with biases, sliding windows (including layers with different windows,
which the plan serves from different mask slots) and left padding; plus its errors."""
from __future__ import annotations

import importlib

import pytest
import torch

from compress.ops import native_available
from compress.runtime.models.llama import build_model, make_decode_plan

from test_decode_layer import checkpoint, step_logits

pytestmark = pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")

PROMPTS = [[5, 9, 13, 21, 8, 40, 3], [11, 4, 7]]  # the second row is left-padded


def plan_vs_op(model, steps: int = 9) -> None:
    plan = model.decode_plan
    assert plan is not None and plan.n_layers == len(model.layers)
    got = step_logits(model, PROMPTS, steps, fused=True)
    model.decode_plan = None  # one decode_layer op call per layer
    try:
        want = step_logits(model, PROMPTS, steps, fused=True)
    finally:
        model.decode_plan = plan
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"step {step}: max diff {(g - w).abs().max()}"


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 5})],
                         ids=["llama", "qwen2", "mistral-window"])
@pytest.mark.parametrize("scheme", ["dense", "w4a16", "w8a8", "llm_int8", "llm_int8_guarded"])
def test_plan_matches_per_layer_op(tokenizer, family, overrides, scheme):
    plan_vs_op(build_model(checkpoint(family, scheme, len(tokenizer), **overrides)))


def test_layers_with_different_windows_use_their_own_masks(tokenizer):
    model = build_model(checkpoint("mistral", "w4a16", len(tokenizer), sliding_window=4))
    model.layers[0].window = None  # layer 0 sees every key, the others the last 4
    make_decode_plan(model)
    assert model.decode_windows == [None, 4]
    plan_vs_op(model, steps=8)
    # and the windows matter here: all layers windowed gives other logits after the window fills
    full = step_logits(model, PROMPTS, 8, fused=True)
    model.layers[0].window = 4
    make_decode_plan(model)
    assert model.decode_windows == [4]
    assert not torch.equal(step_logits(model, PROMPTS, 8, fused=True)[-1], full[-1])


def test_no_plan_without_the_fused_decode(tokenizer):
    model = build_model(checkpoint("llama", "w8a8", len(tokenizer)), fuse=False)  # q/k/v unfused: module path
    assert not model.fused_decode and model.decode_plan is None
    assert build_model(checkpoint("llama", "w8a8", len(tokenizer)), kernels="reference").decode_plan is None


def test_plan_errors_name_the_problem(tokenizer):
    plan_class = importlib.import_module("compress._C").DecodePlan
    with pytest.raises(RuntimeError, match="n_heads 6 must be a positive multiple of n_kv_heads 4"):
        plan_class(6, 4)
    model = build_model(checkpoint("llama", "w8a8", len(tokenizer)))
    layer = model.layers[0]
    attn_norm, mlp_norm, eps, schemes, group_sizes, weights, biases = layer.decode_args
    plan = plan_class(layer.attn.n_heads, model.n_kv_heads)
    h = torch.zeros(1, attn_norm.shape[0])
    cos = torch.zeros(1, model.head_dim)
    k = torch.zeros(1, 1, model.n_kv_heads, 8, model.head_dim)
    with pytest.raises(RuntimeError, match="the plan has no layers"):
        plan.step(h, cos, cos, k, k, 0, [None])
    with pytest.raises(RuntimeError, match="unknown linear scheme 'w3a16'"):
        plan.add_layer(attn_norm, mlp_norm, eps, ["w3a16", *schemes[1:]], group_sizes, weights, biases, 0)
    with pytest.raises(RuntimeError, match="weights has"):
        plan.add_layer(attn_norm, mlp_norm, eps, schemes, group_sizes, weights[:-1], biases, 0)
    plan.add_layer(attn_norm, mlp_norm, eps, schemes, group_sizes, weights, biases, 1)
    with pytest.raises(RuntimeError, match=r"caches must be \[1 layers"):
        plan.step(h, cos, cos, k[0], k[0], 0, [None, None])
    with pytest.raises(RuntimeError, match="layer 0 uses mask 1 but 1 masks were given"):
        plan.step(h, cos, cos, k, k, 0, [None])
    out = plan.step(h, cos, cos, k, k, 0, [None, None])
    assert out.shape == h.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 5})],
                         ids=["llama", "qwen2", "mistral-window"])
@pytest.mark.parametrize("scheme", ["dense", "w4a16", "w8a8", "llm_int8"])
def test_one_call_decode_matches_step_path(tokenizer, family, overrides, scheme, monkeypatch):
    """``DecodePlan.decode`` (embedding, rope rows, layers, final norm, lm_head in C++)
    gives the logits of ``plan.step`` plus the Python embedding / norm / lm_head, bit for
    bit, with left padding and windows."""
    from compress.runtime.models.llama import LlamaFamilyModel
    model = build_model(checkpoint(family, scheme, len(tokenizer), **overrides))
    assert model.decode_plan.has_head and model.decodes_in_one_call
    got = step_logits(model, PROMPTS, 9, fused=True)
    monkeypatch.setattr(LlamaFamilyModel, "decodes_in_one_call", property(lambda self: False))
    want = step_logits(model, PROMPTS, 9, fused=True)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == torch.float32 and torch.equal(g, w), f"step {step}: max diff {(g - w).abs().max()}"


def test_one_call_decode_greedy_generation(tokenizer, monkeypatch):
    """End to end through LLM.generate: the same greedy tokens with and without the head."""
    from compress.runtime import LLM, SamplingParams
    from compress.runtime.models.llama import LlamaFamilyModel
    llm = LLM.from_checkpoint(checkpoint("llama", "w4a16", len(tokenizer)), tokenizer=tokenizer)
    assert llm.model.decodes_in_one_call
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate([[5, 9, 13, 21], [11, 4]], params)]
    monkeypatch.setattr(LlamaFamilyModel, "decodes_in_one_call", property(lambda self: False))
    assert [o.token_ids for o in llm.generate([[5, 9, 13, 21], [11, 4]], params)] == got


def test_decode_tokens_equals_decode_and_its_argmax(tokenizer):
    """decode_tokens (Python ints in, the greedy tokens out) is decode() bit for bit, and
    its tokens are compress::argmax_rows of those logits."""
    model = build_model(checkpoint("llama", "w4a16", len(tokenizer)))
    plan = model.decode_plan
    shape = (len(model.layers), 2, model.n_kv_heads, 8, model.head_dim)
    k1, v1 = torch.randn(shape), torch.randn(shape)
    k2, v2 = k1.clone(), v1.clone()
    mask = [torch.tensor([[True] * 4, [False, True, True, True]])]
    want = plan.decode(torch.tensor([3, 17]), torch.tensor([3, 2]), k1, v1, 3, mask)
    got, tokens = plan.decode_tokens([3, 17], [3, 2], k2, v2, 3, mask, True)
    assert torch.equal(got, want) and torch.equal(k2, k1) and torch.equal(v2, v1)
    assert tokens == torch.ops.compress.argmax_rows(want).tolist()
    assert plan.decode_tokens([3, 17], [3, 2], k2, v2, 3, mask, False)[1] == []
    with pytest.raises(RuntimeError, match="2 token ids and 1 positions"):
        plan.decode_tokens([3, 17], [3], k2, v2, 3, mask, True)


def test_one_call_decode_errors_name_the_problem(tokenizer):
    model = build_model(checkpoint("llama", "w8a8", len(tokenizer)))
    plan = model.decode_plan
    k = torch.zeros(len(model.layers), 1, model.n_kv_heads, 8, model.head_dim)
    ids, pos = torch.tensor([3]), torch.tensor([0])
    with pytest.raises(RuntimeError, match="ids and positions must be int64"):
        plan.decode(ids.int(), pos, k, k, 0, [None])
    with pytest.raises(RuntimeError, match=r"token id 100000 \(row 0\) outside the vocabulary"):
        plan.decode(torch.tensor([100000]), pos, k, k, 0, [None])
    with pytest.raises(RuntimeError, match=r"position -1 \(row 0\) outside the rope table"):
        plan.decode(ids, torch.tensor([-1]), k, k, 0, [None])
    bare = importlib.import_module("compress._C").DecodePlan(model.layers[0].attn.n_heads, model.n_kv_heads)
    with pytest.raises(RuntimeError, match="no head"):
        bare.decode(ids, pos, k, k, 0, [None])
    scheme, group_size, tensors, bias = model.lm_head.decode_spec()
    with pytest.raises(RuntimeError, match=f"lm_head scheme '{scheme}' takes {len(tensors)} tensors, got"):
        bare.set_head(model.embed, model.rope_cos, model.rope_sin, model.norm.weight, model.norm.eps, scheme,
                      group_size, tensors[:-1], bias)
    with pytest.raises(RuntimeError, match="norm_weight must be"):
        bare.set_head(model.embed, model.rope_cos, model.rope_sin, model.norm.weight[:-1], model.norm.eps, scheme,
                      group_size, tensors, bias)
