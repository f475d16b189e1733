"""Helpers for checkpoint I/O tests: a tiny Llama config and a minimal RTN to make QuantizedWeights."""
from __future__ import annotations

import torch

from compress.io.schemes import QuantizedWeight
from compress.ops.reference import INT8_MAX, dequantize_int4, pack_int4

BLOCK_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def tiny_llama_config(**kw):
    from transformers import LlamaConfig
    args = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
    args.update(kw)
    cfg = LlamaConfig(**args)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def int4_rtn(w: torch.Tensor, group_size: int = 128, symmetric: bool = False) -> QuantizedWeight:
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        scale = (g.abs().amax(-1) / 7.0).clamp_min(1e-8)
        zeros = torch.full_like(scale, 8.0)
    else:
        mn, mx = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((mx - mn) / 15.0).clamp_min(1e-8)
        zeros = torch.round(-mn / scale).clamp(0, 15)
    u = torch.round(g / scale.unsqueeze(-1) + zeros.unsqueeze(-1)).clamp(0, 15)
    return QuantizedWeight("w4a16", {"qweight": pack_int4(u.reshape(n, k).to(torch.uint8)),
                                     "scales": scale.contiguous(), "zeros": zeros.to(torch.uint8)},
                           {"group_size": group_size, "in_features": k})


def int8_rtn(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(-1) / INT8_MAX).clamp_min(1e-10)
    q = torch.round(w.float() / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def w8a8_rtn(w):
    q, s = int8_rtn(w)
    return QuantizedWeight("w8a8", {"qweight": q, "weight_scale": s}, {})


def llm_int8_rtn(w, n_outliers: int = 3, threshold: float = 6.0):
    q, s = int8_rtn(w)
    idx = torch.arange(n_outliers, dtype=torch.int64) * 7
    return QuantizedWeight("llm_int8", {"qweight": q, "weight_scale": s, "outlier_idx": idx,
                                        "outlier_weight": w[:, idx].float().contiguous()},
                           {"threshold": threshold})


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    return qw.dequantize()


def split_model(state_dict: dict, schemes: dict[str, object]):
    """schemes: module -> function(weight) -> QuantizedWeight. Returns (dense, quantized)."""
    dense = {k: v.clone() for k, v in state_dict.items()}
    quantized = {}
    for mod, fn in schemes.items():
        quantized[mod] = fn(dense.pop(f"{mod}.weight"))
    return dense, quantized


def all_linears(num_layers: int = 2):
    return [f"model.layers.{i}.{lin}" for i in range(num_layers) for lin in BLOCK_LINEARS]


def assert_qw_equal(a: QuantizedWeight, b: QuantizedWeight):
    assert a.scheme == b.scheme
    assert set(a.tensors) == set(b.tensors), (a.tensors.keys(), b.tensors.keys())
    for k in a.tensors:
        x, y = a.tensors[k], b.tensors[k]
        assert x.shape == y.shape, k
        if x.is_floating_point():
            torch.testing.assert_close(x.float(), y.float(), rtol=2e-7, atol=0, msg=k)
        else:
            assert torch.equal(x.to(torch.int64), y.to(torch.int64)), k


def int4_per_channel(w: torch.Tensor, symmetric: bool = False) -> QuantizedWeight:
    """One scale (and zero point) per output row, any K: the RTN quantizer's own core."""
    from quantizers.rtn import RTNConfig, quantize_weight_rtn
    return quantize_weight_rtn(w, RTNConfig(group_size="channel", symmetric=symmetric), "test")
