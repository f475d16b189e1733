"""Llama-family decoder (Llama, Mistral, Qwen2) built from a checkpoint's tensors.

Our own implementation, not transformers' modules: RMSNorm, RoPE, grouped-query
attention through ``scaled_dot_product_attention`` (``enable_gqa``, no head loops),
SwiGLU MLP, optional tied embeddings. Family differences come from the table in
``compress/architectures.py`` (module names, q/k/v bias, sliding window). Every
linear is a runtime layer class (``compress/runtime/layers.py``) chosen by the
checkpoint's scheme for that module, so dense and packed weights run the same code.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from compress.architectures import ArchSpec, get_arch
from compress.ops import _cpu_module, get_op, native_available
from compress.ops.reference import apply_rope
from compress.runtime.heap import release_free_heap
from compress.runtime.hugepages import HugePageArena, relocate_to_huge_pages
from compress.runtime.layers import LAYER_CLASSES, LINEAR_TYPES, Int4Linear, fuse_linears
from compress.w4_activations import DEFAULT_W4_ACTIVATIONS, check_w4_activations
from compress.runtime.models.rope import inverse_frequencies, rope_tables

SUPPORTED_ACTIVATIONS = ("silu", "swish")


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.backend = "native"

    def prepare(self, backend: str = "native") -> None:
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_op("rms_norm", self.backend)(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` in one call."""
        return get_op("add_rms_norm", self.backend)(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """GQA attention. With ``fuse`` (the default) q/k/v become one linear (one kernel
    call per step) when their schemes allow it (``layers.fuse_linears``)."""

    def __init__(self, q_proj, k_proj, v_proj, o_proj, n_heads: int, n_kv_heads: int, head_dim: int,
                 fuse: bool = True):
        super().__init__()
        self.qkv_proj = fuse_linears([q_proj, k_proj, v_proj]) if fuse else None
        if self.qkv_proj is None:
            self.q_proj, self.k_proj, self.v_proj = q_proj, k_proj, v_proj
        self.o_proj = o_proj
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.backend = "native"

    def prepare(self, backend: str = "native") -> None:
        self.backend = backend

    def _qkv(self, x, cos, sin):
        b, t, _ = x.shape
        nq, nkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(b, t, nq + 2 * nkv, d).transpose(1, 2)
            qk = apply_rope(qkv[:, :nq + nkv], cos, sin)  # one rotation for q and k
            return qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:]
        q = self.q_proj(x).view(b, t, nq, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, nkv, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, nkv, d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, kv, start: int, mask, is_causal: bool):
        b, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        if kv is not None:
            k_cache, v_cache = kv
            k_cache[:b, :, start:start + t] = k
            v_cache[:b, :, start:start + t] = v
            k, v = k_cache[:b, :, :start + t], v_cache[:b, :, :start + t]
        if t == 1 and not is_causal:  # decode step: one query per row
            y = get_op("decode_attention", self.backend)(q.squeeze(2), k, v, key_mask(mask))
            return self.o_proj(y.view(b, 1, -1))
        if k.dtype != q.dtype:  # a float16 KV cache (LLM(kv_cache_dtype="float16"))
            k, v = k.to(q.dtype), v.to(q.dtype)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                           enable_gqa=self.n_heads != self.n_kv_heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU; gate and up fused into one linear when their schemes allow it."""

    def __init__(self, gate_proj, up_proj, down_proj, fuse: bool = True):
        super().__init__()
        self.gate_up_proj = fuse_linears([gate_proj, up_proj]) if fuse else None
        if self.gate_up_proj is None:
            self.gate_proj, self.up_proj = gate_proj, up_proj
        self.down_proj = down_proj
        self.intermediate = gate_proj.out_features

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: MLP, attn_norm: RMSNorm, mlp_norm: RMSNorm,
                 window: int | None):
        super().__init__()
        self.attn, self.mlp, self.attn_norm, self.mlp_norm = attn, mlp, attn_norm, mlp_norm
        self.window = window
        self.decode_args: tuple | None = None

    def prepare_decode(self, backend: str) -> None:
        """Collect this layer's tensors for ``compress::decode_layer`` (the whole layer in
        one native call per decode step) when the native CPU kernels are loaded and every
        linear has a form the op takes (q/k/v and gate/up fused).
        Otherwise ``decode_args`` stays ``None`` and decode runs the modules."""
        self.decode_args = None
        attn, mlp = self.attn, self.mlp
        if (backend != "native" or not native_available("cpu") or self.attn_norm.weight.device.type != "cpu"
                or attn.qkv_proj is None or mlp.gate_up_proj is None):
            return
        specs = [linear.decode_spec() for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(spec is None for spec in specs):
            return
        if any(spec[0] == "dense" and spec[2][0].dtype != self.attn_norm.weight.dtype for spec in specs):
            return
        self.decode_args = (self.attn_norm.weight, self.mlp_norm.weight, self.attn_norm.eps,
                            [spec[0] for spec in specs], [spec[1] for spec in specs],
                            [t for spec in specs for t in spec[2]], [spec[3] for spec in specs])

    def forward(self, x, cos, sin, kv, start, mask, is_causal):
        a = self.attn(self.attn_norm(x), cos, sin, kv, start, mask, is_causal)
        h, x = self.mlp_norm.add_forward(a, x)
        return x + self.mlp(h)


class LlamaFamilyModel(nn.Module):
    """``forward`` returns final hidden states; ``logits`` applies the LM head (fp32 out)."""

    def __init__(self, embed: torch.Tensor, layers: list[DecoderLayer], norm: RMSNorm, lm_head: nn.Module,
                 inv_freq: torch.Tensor, max_seq_len: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.embed = nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm, self.lm_head = norm, lm_head
        self.max_seq_len, self.n_kv_heads, self.head_dim = max_seq_len, n_kv_heads, head_dim
        cos, sin = rope_tables(inv_freq, max_seq_len)
        self.register_buffer("rope_cos", cos.to(embed.device), persistent=False)
        self.register_buffer("rope_sin", sin.to(embed.device), persistent=False)
        # decode steps run each layer as one compress::decode_layer call; build_model sets
        # it when every layer allows that (DecoderLayer.prepare_decode). False forces the
        # module path.
        self.fused_decode = False
        # ... and, with the native CPU kernels, all layers in one call of a
        # compress._C.DecodePlan built once (make_decode_plan); None calls the op per layer.
        self.decode_plan = None
        self.decode_windows: list = []  # the plan's mask slots: one attention window each

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache=None,
                start: int = 0, key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``/``positions`` ``[B, T]``; the queries occupy cache slots
        ``start .. start+T-1``; ``key_valid [B, start+T]`` marks real (non-pad) slots,
        ``None`` when all are real."""
        x = F.embedding(input_ids, self.embed)
        t = input_ids.shape[1]
        masks = {window: attention_mask(t, start, key_valid, window, x.device)
                 for window in {layer.window for layer in self.layers}}
        if t == 1 and kv_cache is not None and self.fused_decode:
            return self.norm(self._decode_fused(x, positions, kv_cache, start, masks))
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)
        for i, layer in enumerate(self.layers):
            mask, is_causal = masks[layer.window]
            kv = None if kv_cache is None else kv_cache.layer(i)
            x = layer(x, cos, sin, kv, start, mask, is_causal)
        return self.norm(x)

    def _decode_fused(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, start: int,
                      masks: dict) -> torch.Tensor:
        """A decode step (one token per row, written at cache slot ``start``), one
        ``compress::decode_layer`` call per layer. ``x [B, 1, H]`` -> ``[B, 1, H]``."""
        b = x.shape[0]
        h = x.view(b, -1)
        cos = self.rope_cos[positions[:, 0]].to(h.dtype)
        sin = self.rope_sin[positions[:, 0]].to(h.dtype)
        key_masks = {window: key_mask(mask) for window, (mask, _) in masks.items()}
        if self.decode_plan is not None:
            h = self.decode_plan.step(h, cos, sin, kv_cache.k, kv_cache.v, start,
                                      [key_masks[window] for window in self.decode_windows])
            return h.view(b, 1, -1)
        n_heads = self.layers[0].attn.n_heads
        op = torch.ops.compress.decode_layer.default  # the overload itself: ~18 us less per call
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_cache.layer(i)
            h = op(h, *layer.decode_args, cos, sin, k_cache, v_cache, start, key_masks[layer.window],
                   n_heads, self.n_kv_heads)
        return h.view(b, 1, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def decodes_in_one_call(self) -> bool:
        """Whether :meth:`decode_logits` runs (a DecodePlan with its head)."""
        return self.fused_decode and self.decode_plan is not None and self.decode_plan.has_head

    def decode_logits(self, ids: list[int], positions: list[int], kv_cache, start: int,
                      key_valid: torch.Tensor | None = None,
                      greedy: bool = False) -> tuple[torch.Tensor, list[int] | None]:
        """A decode step in one ``DecodePlan.decode_tokens`` call: token ``ids`` at
        ``positions`` (Python ints, one per row) written at cache slot ``start`` ->
        ``(fp32 logits [B, V], each row's argmax token if greedy else None)``. The logits
        are what ``logits(forward(...)[:, -1])`` gives, bit for bit; the step makes no
        tensor op in Python except the masks of padded or windowed batches."""
        masks = [key_mask(attention_mask(1, start, key_valid, window, kv_cache.k.device)[0])
                 for window in self.decode_windows]
        logits, tokens = self.decode_plan.decode_tokens(ids, positions, kv_cache.k, kv_cache.v, start, masks, greedy)
        return logits, (tokens if greedy else None)


def key_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A one-query ``attention_mask`` ``[B|1, 1, 1, S]`` as the decode ops take it: ``[B|1, S]``."""
    return None if mask is None else mask.reshape(mask.shape[0], mask.shape[-1])


def attention_mask(t: int, start: int, key_valid: torch.Tensor | None, window: int | None,
                   device) -> tuple[torch.Tensor | None, bool]:
    """``(mask [B|1, 1, T, S] bool or None, is_causal)`` for queries at slots
    ``start..start+T-1`` over keys ``0..S-1`` (S = start + T).

    Causal, optionally windowed (a query sees keys less than ``window`` slots back),
    restricted to valid keys. A query always sees its own slot, so padded query rows
    stay finite."""
    s = start + t
    windowed = window is not None and s > window
    if key_valid is None and not windowed:
        if t == 1:
            return None, False
        if start == 0:
            return None, True
    q_slot = torch.arange(start, s, device=device).unsqueeze(1)
    k_slot = torch.arange(s, device=device).unsqueeze(0)
    allowed = k_slot <= q_slot
    if windowed:
        allowed = allowed & (k_slot > q_slot - window)
    if key_valid is not None:
        allowed = (allowed.unsqueeze(0) & key_valid[:, None, :s]) | (k_slot == q_slot).unsqueeze(0)
    else:
        allowed = allowed.unsqueeze(0)
    return allowed.unsqueeze(1), False


# ----------------------------------------------------------------------------- building

def layer_windows(config, arch: ArchSpec) -> list[int | None]:
    """Sliding-attention window per layer (``None`` = full attention)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"unsupported attention layer types {unknown} in config")
        return [window if kind == "sliding_attention" and window else None for kind in types]
    if arch.sliding_window and window and getattr(config, "use_sliding_window", True):
        return [window] * n
    return [None] * n


class CheckpointTensors:
    """Fetches named tensors from a checkpoint, moved to device (floats cast to dtype)."""

    def __init__(self, ckpt, dtype: torch.dtype, device):
        self.ckpt, self.dtype, self.device = ckpt, dtype, torch.device(device)

    def dense(self, name: str, required: bool = True) -> torch.Tensor | None:
        t = self.ckpt.dense.get(name)
        if t is None:
            if required:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            return None
        return self.cast(t)

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, self.dtype if t.is_floating_point() else t.dtype)

    def linear(self, path: str) -> nn.Module:
        """The runtime layer for ``path`` (not yet prepared for a backend)."""
        bias = self.dense(path + ".bias", required=False)
        qw = self.ckpt.quantized.get(path)
        if qw is None:
            layer = LAYER_CLASSES["dense"](self.dense(path + ".weight"), bias)
        else:
            cls = LAYER_CLASSES[qw.scheme]
            accepted = inspect.signature(cls.__init__).parameters
            kwargs = {k: (self.cast(v) if qw.scheme == "dense" else v.to(self.device))
                      for k, v in qw.tensors.items()}
            kwargs.update({k: v for k, v in qw.meta.items() if k in accepted and k not in kwargs})
            layer = cls(**kwargs, bias=bias)
        return layer


def build_model(ckpt, dtype: torch.dtype = torch.float32, device="cpu", kernels: str = "native",
                max_seq_len: int | None = None, fuse: bool = True, huge_pages: bool = True,
                w4_activations: str = DEFAULT_W4_ACTIVATIONS) -> LlamaFamilyModel:
    """Our decoder for a checkpoint (``config``, ``dense``, ``quantized``). ``fuse``: q/k/v
    and gate/up run as one linear each where their schemes allow it. ``huge_pages``: on
    the native CPU kernels, the prepared weights move into 2 MiB pages, in the order a
    decode step reads them, each layer as soon as it is prepared (``runtime/hugepages.py``).
    ``w4_activations``: how int4 layers treat their activations, "float" or "int8"
    (``compress/w4_activations.py``)."""
    check_w4_activations(w4_activations)
    config = ckpt.config
    arch = get_arch(getattr(config, "model_type", None), where="config.json")
    act = getattr(config, "hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported; supported: {SUPPORTED_ACTIVATIONS}")
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    eps = config.rms_norm_eps
    max_seq_len = max_seq_len or getattr(config, "max_position_embeddings", 4096)
    tensors = CheckpointTensors(ckpt, dtype, device)
    arena = (HugePageArena() if huge_pages and kernels == "native" and torch.device(device).type == "cpu"
             and native_available("cpu") else None)

    def prepared(module: nn.Module) -> nn.Module:
        """``module`` with its linears, norms and attention prepared for ``kernels`` and,
        with an ``arena``, its linears' streamed tensors moved to 2 MiB pages: done module
        by module as the model is built, so the tensors each step replaces are freed
        (and their pages given back, ``runtime/heap.py``) before the next module is read."""
        for m in module.modules():
            if isinstance(m, Int4Linear):
                m.activations = w4_activations
            if isinstance(m, (*LINEAR_TYPES, RMSNorm, Attention)):
                m.prepare(kernels)
        if arena is not None:
            relocate_to_huge_pages((m for m in module.modules() if isinstance(m, LINEAR_TYPES)), arena)
        release_free_heap()
        return module

    # One decoder layer at a time, built, prepared and moved before the next is read: the
    # checkpoint reads each tensor when asked for, so loading holds the prepared model plus
    # about one layer's checkpoint tensors and intermediates.
    layers = []
    for i, window in enumerate(layer_windows(config, arch)):
        p = arch.block_prefix(i) + "."
        attn = Attention(*(tensors.linear(p + name)
                           for name in (arch.q_proj, arch.k_proj, arch.v_proj, arch.o_proj)),
                         n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, fuse=fuse)
        mlp = MLP(*(tensors.linear(p + name) for name in (arch.gate_proj, arch.up_proj, arch.down_proj)),
                  fuse=fuse)
        layers.append(prepared(DecoderLayer(attn, mlp, RMSNorm(tensors.dense(p + arch.attn_norm + ".weight"), eps),
                                            RMSNorm(tensors.dense(p + arch.mlp_norm + ".weight"), eps), window)))

    embed = tensors.dense(arch.embed_tokens + ".weight")
    if arch.lm_head in ckpt.quantized or arch.lm_head + ".weight" in ckpt.dense:
        lm_head = prepared(tensors.linear(arch.lm_head))
    elif getattr(config, "tie_word_embeddings", False):
        # the embedding is the head's weight: where the head moves, the embedding follows
        # (one copy, not the checkpoint's and the moved one)
        lm_head = prepared(LAYER_CLASSES["dense"](embed))
        embed = lm_head.weight.data
    else:
        raise KeyError(f"checkpoint has no {arch.lm_head!r} weight and tie_word_embeddings is false")
    norm = prepared(RMSNorm(tensors.dense(arch.final_norm + ".weight"), eps))
    model = LlamaFamilyModel(embed, layers, norm, lm_head, inverse_frequencies(config, head_dim),
                             max_seq_len, n_kv, head_dim)
    for layer in layers:
        layer.prepare_decode(kernels)
    model.fused_decode = all(layer.decode_args is not None for layer in layers)
    make_decode_plan(model)
    return model.eval()


def make_decode_plan(model: LlamaFamilyModel) -> None:
    """Hands every layer's ``decode_args`` to a ``compress._C.DecodePlan`` once, so a decode
    step is one native call instead of one ``compress::decode_layer`` call per layer (whose
    ~30 arguments cost ~58 us a call to convert from Python). Leaves ``decode_plan`` None
    where the extension has no DecodePlan."""
    model.decode_plan, model.decode_windows = None, []
    if not model.fused_decode:  # fused_decode implies the native CPU kernels are loaded
        return
    plan_class = getattr(_cpu_module(), "DecodePlan", None)
    if plan_class is None:
        return
    windows = sorted({layer.window for layer in model.layers}, key=lambda w: (w is not None, w or 0))
    plan = plan_class(model.layers[0].attn.n_heads, model.n_kv_heads)
    for layer in model.layers:
        attn_norm, mlp_norm, eps, schemes, group_sizes, weights, biases = layer.decode_args
        plan.add_layer(attn_norm, mlp_norm, eps, schemes, group_sizes, weights, biases, windows.index(layer.window))
    # The embedding, rope rows, final norm and lm_head too, where the lm_head has a form the
    # plan runs: then a step is plan.decode(ids, positions, ...) -> logits, one call
    # instead of ~15 PyTorch ops from Python (each ~20-100 us after a step's weights have
    # streamed through the caches, against ~7 us back to back).
    head = model.lm_head.decode_spec()
    if head is not None:
        scheme, group_size, tensors, bias = head
        plan.set_head(model.embed, model.rope_cos, model.rope_sin, model.norm.weight, model.norm.eps,
                      scheme, group_size, tensors, bias)
    model.decode_plan, model.decode_windows = plan, windows
