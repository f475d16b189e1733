"""Model knowledge as data: one table entry per supported architecture.

Everything the compressor, the pruner and the runtime need to know about a model
family (where the decoder blocks are, which norm feeds which linears, which linears
share an input, what the projections are called) lives here, keyed by the Hugging
Face ``model_type``. No subclasses per model.
"""
from __future__ import annotations

from dataclasses import dataclass
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
    sliding_window: bool = False    # Mistral may use a sliding attention window

    @property
    def block_linears(self) -> tuple[str, ...]:
        """Every linear inside one decoder block, in execution order."""
        return (self.q_proj, self.k_proj, self.v_proj, self.o_proj,
                self.gate_proj, self.up_proj, self.down_proj)

    @property
    def scale_groups(self) -> tuple[ScaleGroup, ...]:
        """Groups of linears sharing an input (what AWQ scales together)."""
        return (
            ScaleGroup(self.attn_norm, "norm", (self.q_proj, self.k_proj, self.v_proj)),
            ScaleGroup(self.v_proj, "linear", (self.o_proj,)),
            ScaleGroup(self.mlp_norm, "norm", (self.gate_proj, self.up_proj)),
            ScaleGroup(self.up_proj, "linear", (self.down_proj,)),
        )

    def block_prefix(self, index: int) -> str:
        return f"{self.layers}.{index}"


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", ("LlamaForCausalLM",)),
    "mistral": ArchSpec("mistral", ("MistralForCausalLM",), sliding_window=True),
    "qwen2": ArchSpec("qwen2", ("Qwen2ForCausalLM",), qkv_bias=True, sliding_window=True),
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
