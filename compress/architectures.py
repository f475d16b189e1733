"""Model knowledge as data: one table entry per supported architecture.

Everything the compressor, the pruner and the runtime need to know about a model
family (where the decoder blocks are, which norm feeds which linears, which linears
share an input, which tensor slices structured pruning removes together, what the
projections are called) lives here, keyed by the Hugging
Face ``model_type``. No subclasses per model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from compress.errors import UserError


@dataclass(frozen=True)
class ScaleGroup:
    """Linears that read the same input, and the operator producing that input.

    ``prev`` is a module path relative to the block whose output feeds every linear
    in ``linears``; ``prev_kind`` says how a per-channel scale can be folded into it:
    'norm' (RMSNorm weight) or 'linear' (rows of the producing linear's weight).
    """
    prev: str
    prev_kind: str
    linears: tuple[str, ...]


ChannelUnit = Literal["channel", "query_head", "kv_head"]


@dataclass(frozen=True)
class ChannelMember:
    """One tensor that a channel group cuts.

    ``tensor``: a parameter name relative to each decoder block (``scope='block'``) or to
    the model (``scope='model'``). ``axis``: the dimension the group's channels index.
    ``role``: 'writes' (output rows: the tensor produces the channel), 'reads' (input
    columns: it consumes it) or 'scales' (a norm weight). ``unit``: what one index of the
    group covers on that axis -- 'channel' (one row or column), 'query_head' (the
    head_dim rows or columns of one query head) or 'kv_head' (the head_dim rows of a
    key/value head, kept while any query head of its group is kept). ``tied_to``: the
    tensor this one is when ``config.tie_word_embeddings`` (then only that one is cut).
    """
    tensor: str
    axis: int
    role: Literal["writes", "reads", "scales"]
    unit: ChannelUnit = "channel"
    scope: Literal["block", "model"] = "block"
    tied_to: str | None = None


@dataclass(frozen=True)
class ChannelGroup:
    """Tensors whose slices along one index space are removed together (structured pruning).

    ``kind`` names the index space and what the cut changes in the config:
    'mlp_channel' (``intermediate_size``, chosen per block), 'query_head'
    (``num_attention_heads`` / ``num_key_value_heads``, chosen per block) and
    'hidden_channel' (``hidden_size``, one choice for the whole residual stream).
    """
    name: str
    kind: Literal["mlp_channel", "query_head", "hidden_channel"]
    members: tuple[ChannelMember, ...]


# the llama family's topology (llama, mistral, qwen2, qwen3): names relative to a decoder block
LLAMA_SCALE_GROUPS = (
    ScaleGroup("input_layernorm", "norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ScaleGroup("self_attn.v_proj", "linear", ("self_attn.o_proj",)),
    ScaleGroup("post_attention_layernorm", "norm", ("mlp.gate_proj", "mlp.up_proj")),
    ScaleGroup("mlp.up_proj", "linear", ("mlp.down_proj",)),
)


def llama_channel_groups(qkv_bias: bool = False) -> tuple[ChannelGroup, ...]:
    """The llama family's prunable channels; ``qkv_bias``: q/k/v carry biases (Qwen2)."""
    M = ChannelMember
    head_biases = ((M("self_attn.q_proj.bias", 0, "writes", "query_head"),
                    M("self_attn.k_proj.bias", 0, "writes", "kv_head"),
                    M("self_attn.v_proj.bias", 0, "writes", "kv_head")) if qkv_bias else ())
    return (
        ChannelGroup("mlp", "mlp_channel", (
            M("mlp.gate_proj.weight", 0, "writes"),
            M("mlp.up_proj.weight", 0, "writes"),
            M("mlp.down_proj.weight", 1, "reads"),
        )),
        ChannelGroup("attention_heads", "query_head", (
            M("self_attn.q_proj.weight", 0, "writes", "query_head"),
            M("self_attn.k_proj.weight", 0, "writes", "kv_head"),
            M("self_attn.v_proj.weight", 0, "writes", "kv_head"),
            *head_biases,
            M("self_attn.o_proj.weight", 1, "reads", "query_head"),
        )),
        ChannelGroup("hidden", "hidden_channel", (
            M("model.embed_tokens.weight", 1, "writes", scope="model"),
            M("input_layernorm.weight", 0, "scales"),
            M("self_attn.q_proj.weight", 1, "reads"),
            M("self_attn.k_proj.weight", 1, "reads"),
            M("self_attn.v_proj.weight", 1, "reads"),
            M("self_attn.o_proj.weight", 0, "writes"),
            M("post_attention_layernorm.weight", 0, "scales"),
            M("mlp.gate_proj.weight", 1, "reads"),
            M("mlp.up_proj.weight", 1, "reads"),
            M("mlp.down_proj.weight", 0, "writes"),
            M("model.norm.weight", 0, "scales", scope="model"),
            M("lm_head.weight", 1, "reads", scope="model", tied_to="model.embed_tokens.weight"),
        )),
    )


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    hf_architectures: tuple[str, ...]
    embed_tokens: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    layers: str = "model.layers"
    rotary_emb: str = "model.rotary_emb"   # holds buffers only, rebuilt from the config
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    q_proj: str = "self_attn.q_proj"
    k_proj: str = "self_attn.k_proj"
    v_proj: str = "self_attn.v_proj"
    o_proj: str = "self_attn.o_proj"
    gate_proj: str = "mlp.gate_proj"
    up_proj: str = "mlp.up_proj"
    down_proj: str = "mlp.down_proj"
    qkv_bias: bool = False          # Qwen2 has biases on q/k/v
    # Qwen3: an RMSNorm over each head's head_dim on q and on k, after the projection and
    # before RoPE (weights [head_dim], one for every query head, one for every kv head)
    qk_norm: bool = False
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    sliding_window: bool = False    # Mistral may use a sliding attention window
    # groups of linears sharing an input (what AWQ scales together), relative to a block
    scale_groups: tuple[ScaleGroup, ...] = LLAMA_SCALE_GROUPS
    # what structured pruning can cut together (pruning/channel_slices.py)
    channel_groups: tuple[ChannelGroup, ...] = llama_channel_groups()

    @property
    def block_linears(self) -> tuple[str, ...]:
        """Every linear inside one decoder block, in execution order."""
        return (self.q_proj, self.k_proj, self.v_proj, self.o_proj,
                self.gate_proj, self.up_proj, self.down_proj)

    def channel_group(self, name: str) -> ChannelGroup:
        for group in self.channel_groups:
            if group.name == name:
                return group
        raise KeyError(f"{self.model_type} has no channel group {name!r}; "
                       f"its groups: {', '.join(g.name for g in self.channel_groups)}")

    def block_prefix(self, index: int) -> str:
        return f"{self.layers}.{index}"


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", ("LlamaForCausalLM",)),
    "mistral": ArchSpec("mistral", ("MistralForCausalLM",), sliding_window=True),
    "qwen2": ArchSpec("qwen2", ("Qwen2ForCausalLM",), qkv_bias=True, sliding_window=True,
                      channel_groups=llama_channel_groups(qkv_bias=True)),
    "qwen3": ArchSpec("qwen3", ("Qwen3ForCausalLM",), qk_norm=True, sliding_window=True),
}


class UnsupportedArchitectureError(UserError):
    pass


def get_arch(model_type: str, where: str = "") -> ArchSpec:
    """The table entry for ``model_type``; a clear error listing what is supported."""
    spec = ARCHITECTURES.get(model_type)
    if spec is None:
        supported = ", ".join(f"{k} ({', '.join(v.hf_architectures)})" for k, v in ARCHITECTURES.items())
        loc = f" in {where}" if where else ""
        raise UnsupportedArchitectureError(
            f"unsupported model_type {model_type!r}{loc}; compress supports: {supported}")
    return spec
