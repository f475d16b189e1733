"""The native decode step: a whole decode step on the paged KV cache in one C++ call.

``build_native_decode(model)`` hands every layer's tensors to a ``compress._C.DecodePlan``
once (norm weights, Qwen3's q / k norm weights, the four fused linears in the forms
their ``decode_spec()`` names, the attention window) plus the embedding, rope tables, final norm and lm_head. A step is
then ``NativeDecode.decode``: Python ints and the cache tensors in, fp32 logits (and the
greedy tokens) out, with no tensor op in Python. Where the plan cannot take the model
(no native CPU kernels, a model off the CPU, reference kernels, unfused q/k/v or
gate/up, a linear without a decode form) it returns None and the runtime decodes
through the modules.
"""
from __future__ import annotations

import torch

from compress.ops import _cpu_module, native_available


class NativeDecode:
    """A built ``DecodePlan`` and the one call a decode step makes."""

    def __init__(self, plan):
        self.plan = plan

    def decode(self, ids: list[int], positions: list[int], k_pool: torch.Tensor, v_pool: torch.Tensor,
               block_tables: torch.Tensor, greedy: bool,
               logit_rows: list[int] | None = None) -> tuple[torch.Tensor, list[int] | None]:
        """Token ``ids[r]`` at ``positions[r]`` for each row r; ``k_pool``/``v_pool``
        ``[n_layers, num_blocks, n_kv_heads, block_size, head_dim]`` (each layer's new k/v
        written at the row's position through ``block_tables`` int32 ``[B, M]``, then
        attention over positions ``0..positions[r]`` within the layer's window) ->
        ``(fp32 logits [B, vocab], each row's argmax token if greedy else None)``;
        ``logit_rows``: only those rows' logits and tokens, in that order (the head skips
        the rest; ``[]``: no head at all)."""
        logits, tokens = self.plan.decode_tokens(ids, positions, k_pool, v_pool, block_tables, greedy, logit_rows)
        return logits, (tokens if greedy else None)


def _layer_arguments(layer) -> tuple | None:
    """``DecodePlan.add_layer``'s arguments for one decoder layer, or None where a linear
    has no decode form (q/k/v or gate/up unfused, no ``decode_spec``, a dense weight in
    another dtype than the activations)."""
    attn, mlp = layer.attn, layer.mlp
    if getattr(attn, "qkv_proj", None) is None or getattr(mlp, "gate_up_proj", None) is None:
        return None
    specs = [linear.decode_spec() for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(spec is None for spec in specs):
        return None
    dtype = layer.attn_norm.weight.dtype
    if any(spec[0] == "dense" and spec[2][0].dtype != dtype for spec in specs):
        return None
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q_norm is not None and (q_norm.eps != layer.attn_norm.eps or k_norm.eps != layer.attn_norm.eps):
        return None   # the plan takes one eps a layer
    return (layer.attn_norm.weight, layer.mlp_norm.weight, layer.attn_norm.eps,
            [spec[0] for spec in specs], [spec[1] for spec in specs],
            [t for spec in specs for t in spec[2]], [spec[3] for spec in specs], int(layer.window or 0),
            None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight)


def build_native_decode(model) -> NativeDecode | None:
    """The native decode step of ``model`` (a ``LlamaFamilyModel``), or None where the
    plan cannot run it (see the module docstring)."""
    if not native_available("cpu") or model.embed.device.type != "cpu":
        return None
    plan_class = getattr(_cpu_module(), "DecodePlan", None)
    if plan_class is None or not len(model.layers):
        return None
    if any(getattr(layer.attn, "backend", "native") != "native" for layer in model.layers):
        return None
    layers = [_layer_arguments(layer) for layer in model.layers]
    head = model.lm_head.decode_spec() if hasattr(model.lm_head, "decode_spec") else None
    if head is None or any(args is None for args in layers):
        return None
    plan = plan_class(model.layers[0].attn.n_heads, model.n_kv_heads)
    for args in layers:
        plan.add_layer(*args)
    scheme, group_size, tensors, bias = head
    plan.set_head(model.embed, model.rope_cos, model.rope_sin, model.norm.weight, model.norm.eps,
                  scheme, group_size, tensors, bias)
    return NativeDecode(plan)
