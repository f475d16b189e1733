"""The native decode step (``compress.runtime.native_decode``: one ``DecodePlan.decode_tokens``
call per step on the paged KV cache) against the same step run module by module with the
reference paged attention: same logits and same cache contents at every step, for every
linear scheme the plan takes, with q/k/v biases (qwen2), q/k norms (qwen3), sliding windows (mistral, and
layers with different windows), rows at different positions in one batch, block tables in
shuffled order, bf16 activations, fp16 / bf16 pools and int8 pools; against transformers on the whole
token history; greedy tokens; when no plan is built; errors."""
from __future__ import annotations

import importlib
import random

import pytest
import torch
import torch.nn.functional as F

from compress.io.schemes import QuantizedWeight
from compress.ops import kv_int8, native_available, reference
from compress.runtime.loading import RuntimeCheckpoint
from compress.runtime.models.llama import build_model
from compress.runtime.native_decode import build_native_decode

from runtime_models import hf_model, tiny_config
from test_quantized import quantized_pair

pytestmark = pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")

GUARD_THRESHOLD = 1.0  # low enough that the tiny model's activations spike past it every step
BLOCK = 4  # small blocks: rows cross block boundaries every few steps
STARTS = [0, 3, 5]  # row r joins the batch at step STARTS[r]: rows sit at different positions


def checkpoint(family: str, scheme: str, vocab: int, **overrides):
    """A tiny checkpoint: ``scheme`` dense, w4a16, w8a8, llm_int8 (static outlier set) or
    llm_int8_guarded (the same with the spike guard at GUARD_THRESHOLD); and the HF model
    holding the (dequantized) weights."""
    if scheme == "dense":
        model = hf_model(tiny_config(family, vocab, **overrides))
        return RuntimeCheckpoint(model.config, {k: v.clone() for k, v in model.state_dict().items()}, {}), model
    ckpt, model = quantized_pair(family, scheme.removesuffix("_guarded"), vocab, **overrides)
    if scheme.startswith("llm_int8"):
        meta = {"threshold": GUARD_THRESHOLD} if scheme == "llm_int8_guarded" else {}
        ckpt.quantized = {k: QuantizedWeight(q.scheme, q.tensors, meta) for k, q in ckpt.quantized.items()}
    return ckpt, model


class PagedCache:
    """Pools ``[layers, blocks, kv heads, BLOCK, head_dim]`` and per-row block lists drawn
    from a shuffled free list (rows' blocks interleave and are never in order)."""

    def __init__(self, model, rows: int, max_len: int, dtype, seed: int = 0):
        self.per_row = -(-max_len // BLOCK)
        n_blocks = rows * self.per_row + 2
        shape = (len(model.layers), n_blocks, model.n_kv_heads, BLOCK, kv_int8.row_elems(model.head_dim, dtype))
        self.k, self.v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.free = list(range(n_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: list[list[int]] = [[] for _ in range(rows)]

    def tables(self, rows: list[int], positions: list[int]) -> torch.Tensor:
        """int32 ``[len(rows), per_row]``; a block is taken when a row reaches it; -1 past
        a row's blocks (never read)."""
        out = torch.full((len(rows), self.per_row), -1, dtype=torch.int32)
        for i, (r, p) in enumerate(zip(rows, positions)):
            while len(self.blocks[r]) <= p // BLOCK:
                self.blocks[r].append(self.free.pop())
            out[i, :len(self.blocks[r])] = torch.tensor(self.blocks[r], dtype=torch.int32)
        return out

    def clone(self) -> "PagedCache":
        other = object.__new__(PagedCache)
        other.__dict__.update(self.__dict__, k=self.k.clone(), v=self.v.clone())
        return other


def module_step(model, ids: list[int], positions: list[int], k_pool, v_pool, tables) -> torch.Tensor:
    """The decode step through the model's modules (its linears, norms and MLPs) with the
    reference paged attention: what the native plan must compute. fp32 logits ``[B, V]``."""
    nq, nkv, d = model.layers[0].attn.n_heads, model.n_kv_heads, model.head_dim
    ids_t, pos_t = torch.tensor(ids), torch.tensor(positions)
    x = F.embedding(ids_t, model.embed)
    b = x.shape[0]
    cos, sin = model.rope_cos[pos_t].to(x.dtype).unsqueeze(1), model.rope_sin[pos_t].to(x.dtype).unsqueeze(1)
    blk = tables[torch.arange(b), pos_t // BLOCK].long()
    off = pos_t % BLOCK
    lens = (pos_t + 1).to(torch.int32)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            qkv = layer.attn.qkv_proj(layer.attn_norm(x)).view(b, nq + 2 * nkv, d)
            qk = qkv[:, :nq + nkv]
            if layer.attn.q_norm is not None:   # Qwen3: per-head norms before rope
                qk = torch.cat([layer.attn.q_norm(qkv[:, :nq]), layer.attn.k_norm(qkv[:, nq:nq + nkv])], 1)
            qk = reference.apply_rope(qk, cos, sin)
            k_pool[i][blk, :, off] = kv_int8.to_pool(qk[:, nq:], k_pool.dtype)
            v_pool[i][blk, :, off] = kv_int8.to_pool(qkv[:, nq + nkv:], v_pool.dtype)
            a = torch.ops.compress.paged_decode_attention(qk[:, :nq], k_pool[i], v_pool[i], tables, lens,
                                                          layer.window or 0)
            h, x = layer.mlp_norm.add_forward(layer.attn.o_proj(a.reshape(b, nq * d)), x)
            x = x + layer.mlp(h)
        return model.logits(model.norm(x))


def token(step: int, row: int) -> int:
    return (7 * step + 3 * row) % 50 + 2


def run_steps(model, steps: int, kv_dtype=torch.float32):
    """Both paths over ``steps`` steps, each from its own copy of the cache: per step the
    rows in the batch, their positions, and both logits; plus both final caches and the
    greedy tokens of the native path."""
    native = build_native_decode(model)
    assert native is not None
    cache = PagedCache(model, len(STARTS), steps, kv_dtype)
    ref_cache = cache.clone()
    out = []
    for step in range(steps):
        rows = [r for r, s in enumerate(STARTS) if step >= s]
        positions = [step - STARTS[r] for r in rows]
        ids = [token(step, r) for r in rows]
        tables = cache.tables(rows, positions)
        ref_cache.blocks = cache.blocks
        got, greedy = native.decode(ids, positions, cache.k, cache.v, tables, greedy=True)
        want = module_step(model, ids, positions, ref_cache.k, ref_cache.v, tables)
        assert got.dtype == torch.float32 and got.shape == (len(rows), model.vocab_size)
        assert greedy == got.argmax(-1).tolist()
        assert native.decode(ids, positions, cache.k.clone(), cache.v.clone(), tables, greedy=False)[1] is None
        out.append((rows, positions, got, want))
        if step == 0:
            first = got.clone()
    assert torch.equal(out[0][2], first)  # a step's logits are its own tensor, untouched by later steps
    return out, cache, ref_cache


FAMILIES = [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {"sliding_window": 5})]


@pytest.mark.parametrize("family,overrides", FAMILIES, ids=["llama", "qwen2", "qwen3", "mistral-window"])
@pytest.mark.parametrize("scheme", ["dense", "w4a16", "w8a8", "llm_int8", "llm_int8_guarded"])
def test_native_decode_matches_module_path(tokenizer, family, overrides, scheme):
    model = build_model(checkpoint(family, scheme, len(tokenizer), **overrides)[0])
    steps, cache, ref_cache = run_steps(model, 11)
    for i, (rows, positions, got, want) in enumerate(steps):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {i} {positions}: {m}")
    torch.testing.assert_close(cache.k, ref_cache.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.v, ref_cache.v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family,overrides", FAMILIES, ids=["llama", "qwen2", "qwen3", "mistral-window"])
def test_native_decode_matches_transformers_on_the_whole_history(tokenizer, family, overrides):
    """Each row's last logits equal transformers' logits for the row's whole token history
    (no cache): positions, block tables and windows mean what they should."""
    ckpt, hf = checkpoint(family, "dense", len(tokenizer), **overrides)
    steps, _, _ = run_steps(build_model(ckpt), 12)
    rows, positions, got, _ = steps[-1]
    for i, r in enumerate(rows):
        history = torch.tensor([[token(s, r) for s in range(STARTS[r], len(steps))]])
        assert history.shape[1] == positions[i] + 1
        with torch.no_grad():
            want = hf(history).logits[0, -1]
        torch.testing.assert_close(got[i], want, atol=1e-4, rtol=1e-4)


def test_layers_with_different_windows(tokenizer):
    ckpt, _ = checkpoint("mistral", "w4a16", len(tokenizer), sliding_window=3)
    model = build_model(ckpt)
    model.layers[0].window = None  # layer 0 sees every key, the others the last 3
    assert build_native_decode(model).plan.windows == [0, 3]
    steps, _, _ = run_steps(model, 9)
    for rows, positions, got, want in steps:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    model.layers[0].window = 3  # and the window matters once the rows are past it
    assert not torch.allclose(run_steps(model, 9)[0][-1][2], steps[-1][2])


def test_bfloat16_activations(tokenizer):
    model = build_model(checkpoint("qwen2", "w8a8", len(tokenizer))[0], dtype=torch.bfloat16)
    for rows, positions, got, want in run_steps(model, 7, kv_dtype=torch.bfloat16)[0]:
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)  # elementwise steps round where modules do


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_half_size_pools(tokenizer, kv_dtype):
    """A float16 / bfloat16 pool under fp32 activations: both paths round the keys and
    values alike (layer 0's, from the same inputs, bit for bit; later layers' inputs differ
    in the last bits), and the rounding moves the logits only a little."""
    model = build_model(checkpoint("llama", "w4a16", len(tokenizer))[0])
    exact = run_steps(model, 9)[0]
    half, cache, ref_cache = run_steps(model, 9, kv_dtype)
    assert torch.equal(cache.k[0], ref_cache.k[0]) and torch.equal(cache.v[0], ref_cache.v[0])
    torch.testing.assert_close(cache.k, ref_cache.k, atol=1e-5, rtol=1e-3)
    torch.testing.assert_close(cache.v, ref_cache.v, atol=1e-5, rtol=1e-3)
    for (_, _, got, want), (_, _, e, _) in zip(half, exact):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert 0 < (got - e).abs().max() < 0.05 * e.abs().max()


def test_int8_pools(tokenizer):
    """An int8 pool (a scale a row) under fp32 activations: layer 0's rows are the same
    bits on both paths (the C++ store quantizes as kv_int8.quantize_rows does); later
    layers' inputs differ in the last bits, so a value may sit one step of its row's scale
    apart; the logits stay close to the exact cache's."""
    model = build_model(checkpoint("llama", "w4a16", len(tokenizer))[0])
    exact = run_steps(model, 9)[0]
    steps, cache, ref_cache = run_steps(model, 9, torch.int8)
    assert cache.k.dtype == torch.int8 and cache.k.shape[-1] == model.head_dim + kv_int8.SCALE_BYTES
    assert torch.equal(cache.k[0], ref_cache.k[0]) and torch.equal(cache.v[0], ref_cache.v[0])
    for pool, ref_pool in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
        step = kv_int8.row_scales(ref_pool).unsqueeze(-1)
        assert ((kv_int8.dequantize_rows(pool) - kv_int8.dequantize_rows(ref_pool)).abs() <= step * 1.001).all()
    for (_, _, got, want), (_, _, e, _) in zip(steps, exact):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
        assert 0 < (got - e).abs().max() < 0.1 * e.abs().max()


def test_no_native_decode_where_the_plan_cannot_run(tokenizer):
    ckpt = checkpoint("llama", "w8a8", len(tokenizer))[0]
    assert build_native_decode(build_model(ckpt, fuse=False)) is None  # q/k/v unfused
    assert build_native_decode(build_model(ckpt, kernels="reference")) is None


def test_errors_name_the_problem(tokenizer):
    model = build_model(checkpoint("llama", "w8a8", len(tokenizer))[0])
    native = build_native_decode(model)
    cache = PagedCache(model, 1, 8, torch.float32)
    tables = cache.tables([0], [0])
    with pytest.raises(RuntimeError, match="2 token ids and 1 positions"):
        native.decode([3, 4], [0], cache.k, cache.v, tables, True)
    with pytest.raises(RuntimeError, match=r"token id 100000 \(row 0\) outside the vocabulary"):
        native.decode([100000], [0], cache.k, cache.v, tables, True)
    with pytest.raises(RuntimeError, match=r"position -1 \(row 0\) outside the rope table"):
        native.decode([3], [-1], cache.k, cache.v, tables, True)
    with pytest.raises(RuntimeError, match=r"context_lens\[0\] = 9 is outside 1..8"):
        native.decode([3], [8], cache.k, cache.v, tables, True)
    bad = tables.clone()
    bad[0, 0] = cache.k.shape[1]
    with pytest.raises(RuntimeError, match=r"block table entry \[0, 0\] = \d+ is in use but outside"):
        native.decode([3], [0], cache.k, cache.v, bad, True)
    with pytest.raises(RuntimeError, match="block_tables must be an int32"):
        native.decode([3], [0], cache.k, cache.v, tables.long(), True)
    with pytest.raises(RuntimeError, match=r"k_pool and v_pool must be \[2 layers"):
        native.decode([3], [0], cache.k[:1], cache.v[:1], tables, True)
    with pytest.raises(RuntimeError, match="one dtype"):
        native.decode([3], [0], cache.k, cache.v.half(), tables, True)
    plan_class = importlib.import_module("compress._C").DecodePlan
    with pytest.raises(RuntimeError, match="n_heads 6 must be a positive multiple of n_kv_heads 4"):
        plan_class(6, 4)
    bare = plan_class(model.layers[0].attn.n_heads, model.n_kv_heads)
    with pytest.raises(RuntimeError, match="no head"):
        bare.decode_tokens([3], [0], cache.k, cache.v, tables, True)
    scheme, group_size, tensors, bias = model.lm_head.decode_spec()
    with pytest.raises(RuntimeError, match=f"lm_head scheme '{scheme}' takes {len(tensors)} tensors, got"):
        bare.set_head(model.embed, model.rope_cos, model.rope_sin, model.norm.weight, model.norm.eps, scheme,
                      group_size, tensors[:-1], bias)
    bare.set_head(model.embed, model.rope_cos, model.rope_sin, model.norm.weight, model.norm.eps, scheme,
                  group_size, tensors, bias)
    with pytest.raises(RuntimeError, match="the plan has no layers"):
        bare.decode_tokens([3], [0], cache.k, cache.v, tables, True)
    layer = model.layers[0]
    specs = [lin.decode_spec() for lin in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
                                          layer.mlp.down_proj)]
    weights = [t for s in specs for t in s[2]]
    with pytest.raises(RuntimeError, match="unknown linear scheme 'w3a16'"):
        bare.add_layer(layer.attn_norm.weight, layer.mlp_norm.weight, 1e-5, ["w3a16"] + [s[0] for s in specs[1:]],
                       [s[1] for s in specs], weights, [s[3] for s in specs], 0)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        bare.add_layer(layer.attn_norm.weight, layer.mlp_norm.weight, 1e-5, [s[0] for s in specs],
                       [s[1] for s in specs], weights, [s[3] for s in specs], -1)
