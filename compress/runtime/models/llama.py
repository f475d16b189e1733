"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) built from a checkpoint's tensors.

Our own implementation, not transformers' modules: RMSNorm, RoPE, grouped-query
attention through ``scaled_dot_product_attention`` (``enable_gqa``, no head loops) or,
for one-token rows of an engine step, the paged decode attention op, SwiGLU MLP,
optional tied embeddings. Two forwards share the layers: a cache-free one over padded
``[B, T]`` batches (scoring) and an engine step over the paged KV cache (every row's
tokens flattened, each at its own positions; ``runtime/step_batch.py``). The native
one-call decode step over the same model objects lives in ``runtime/native_decode.py``. Family differences come from the table in
``compress/architectures.py`` (module names, q/k/v bias, q/k norms, sliding window). Every
linear is a runtime layer class (``compress/runtime/layers.py``) chosen by the
checkpoint's scheme for that module, so dense and packed weights run the same code.
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from compress.architectures import ArchSpec, get_arch
from compress.ops import get_op, native_available
from compress.ops.reference import apply_rope
from compress.runtime.heap import release_free_heap
from compress.runtime.hugepages import HugePageArena, relocate_to_huge_pages
from compress.runtime.layers import LAYER_CLASSES, LINEAR_TYPES, Int4Linear, fuse_linears
from compress.w4_activations import DEFAULT_W4_ACTIVATIONS, check_w4_activations
from compress.runtime.models.rope import inverse_frequencies, rope_tables
from compress.runtime.paged_attention import decode_attention_op, paged_attention, write_kv

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
    call per step) when their schemes allow it (``layers.fuse_linears``). ``forward``:
    a cache-free ``[B, T, H]`` batch; ``forward_paged``: a step's flattened tokens over
    the paged KV cache (``runtime/paged_attention.py``)."""

    def __init__(self, q_proj, k_proj, v_proj, o_proj, n_heads: int, n_kv_heads: int, head_dim: int,
                 fuse: bool = True, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None):
        super().__init__()
        self.qkv_proj = fuse_linears([q_proj, k_proj, v_proj]) if fuse else None
        if self.qkv_proj is None:
            self.q_proj, self.k_proj, self.v_proj = q_proj, k_proj, v_proj
        self.o_proj = o_proj
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm come together (both or neither)")
        self.q_norm, self.k_norm = q_norm, k_norm   # Qwen3: per-head RMSNorms before RoPE
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.backend = "native"
        self.decode_op = decode_attention_op(self.backend)

    def prepare(self, backend: str = "native") -> None:
        self.backend = backend
        self.decode_op = decode_attention_op(backend)

    def _project(self, x, cos, sin):
        """``x [..., H]`` -> q ``[..., Hq, D]``, k, v ``[..., Hkv, D]``, q and k rotated
        (``cos``/``sin`` ``[..., 1, D]``)."""
        lead = x.shape[:-1]
        nq, nkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(*lead, nq + 2 * nkv, d)
            qk = qkv[..., :nq + nkv, :]
            if self.q_norm is not None:
                qk = torch.cat([self.q_norm(qkv[..., :nq, :]), self.k_norm(qkv[..., nq:nq + nkv, :])], dim=-2)
            qk = apply_rope(qk, cos, sin)  # one rotation for q and k
            return qk[..., :nq, :], qk[..., nq:, :], qkv[..., nq + nkv:, :]
        q = self.q_proj(x).view(*lead, nq, d)
        k = self.k_proj(x).view(*lead, nkv, d)
        v = self.v_proj(x).view(*lead, nkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, mask, is_causal: bool):
        """Cache-free: ``x [B, T, H]``, ``cos``/``sin`` ``[B, T, 1, D]``. On the CPU the
        attention is :func:`blocked_attention` (a row's bits do not depend on the batch's
        padded width or size), elsewhere torch's ``scaled_dot_product_attention``."""
        b, t, _ = x.shape
        q, k, v = (y.transpose(1, 2) for y in self._project(x, cos, sin))
        if x.device.type == "cpu":
            y = blocked_attention(q, k, v, mask, is_causal)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                               enable_gqa=self.n_heads != self.n_kv_heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def forward_paged(self, x, cos, sin, kv, batch, window: int | None):
        """A step: ``x [N, H]`` (``step_batch.StepBatch`` says whose tokens), ``cos``/``sin``
        ``[N, 1, D]``; writes the new keys and values into layer ``kv``'s pools."""
        q, k, v = self._project(x, cos, sin)
        k_pool, v_pool = kv
        write_kv(k_pool, v_pool, k, v, batch.block_idx, batch.block_off)
        y = paged_attention(q, k, v, k_pool, v_pool, batch, window, self.decode_op)
        return self.o_proj(y.reshape(x.shape[0], self.n_heads * self.head_dim))


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

    def forward(self, x, cos, sin, mask, is_causal):
        a = self.attn(self.attn_norm(x), cos, sin, mask, is_causal)
        h, x = self.mlp_norm.add_forward(a, x)
        return x + self.mlp(h)

    def forward_paged(self, x, cos, sin, kv, batch):
        a = self.attn.forward_paged(self.attn_norm(x), cos, sin, kv, batch, self.window)
        h, x = self.mlp_norm.add_forward(a, x)
        return x + self.mlp(h)


class LlamaFamilyModel(nn.Module):
    """``forward``: cache-free final hidden states of a ``[B, T]`` batch (scoring);
    ``forward_paged``: one engine step over the paged KV cache; ``logits`` applies the
    LM head (fp32 out)."""

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

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    @property
    def n_heads(self) -> int:
        return self.layers[0].attn.n_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Cache-free: ``input_ids``/``positions`` ``[B, T]``; ``key_valid [B, T]`` marks
        real (non-pad) tokens, ``None`` when all are. Final hidden states ``[B, T, H]``."""
        x = F.embedding(input_ids, self.embed)
        t = input_ids.shape[1]
        masks = {window: attention_mask(t, key_valid, window, x.device)
                 for window in {layer.window for layer in self.layers}}
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(2)
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(2)
        for layer in self.layers:
            mask, is_causal = masks[layer.window]
            x = layer(x, cos, sin, mask, is_causal)
        return self.norm(x)

    def forward_paged(self, batch, kv_cache, out_index: torch.Tensor | None = None) -> torch.Tensor:
        """One engine step (``step_batch.StepBatch``) over ``kv_cache``
        (``kv_cache.PagedKVCache``): writes every new token's keys and values, returns
        the final hidden states ``[len(out_index), H]`` of the tokens ``out_index`` picks
        (all ``[N, H]`` when ``None``)."""
        x = F.embedding(batch.token_ids, self.embed)
        cos = self.rope_cos[batch.positions].to(x.dtype).unsqueeze(1)
        sin = self.rope_sin[batch.positions].to(x.dtype).unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer.forward_paged(x, cos, sin, kv_cache.layer(i), batch)
        return self.norm(x if out_index is None else x[out_index])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


# cache-free attention on the CPU: queries in blocks of this many positions, each against
# the keys up to its block's end, every product in the same shape whatever the padded width
ATTENTION_BLOCK = 64
ATTENTION_BLOCK_BYTES = 256 << 20   # scores of at most this many bytes at once (rows of the batch a pass)


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      is_causal: bool) -> torch.Tensor:
    """Softmax attention of ``q [B, Hq, T, D]`` over ``k``, ``v [B, Hkv, T, D]`` (GQA
    groups of Hq / Hkv), causal or under ``mask`` (bool ``[B|1, 1, T, T]``, True = may
    attend), computed so that a query's result does not depend on the batch it is in:
    torch's CPU ``scaled_dot_product_attention`` splits its work by sequence length, and a
    row scored alone and in a padded batch moved in the last bits (which int8 activations
    amplify: 0.028 nats on a 14-token document of an RTN int8 model). Here queries go in
    blocks of ATTENTION_BLOCK, each against the keys up to its block's end (the last block,
    and its keys, padded to whole blocks): every matmul and softmax has a shape that
    depends only on the block's index, never on T or B, and masked keys weigh exactly 0.
    Only the last block's slices are copied for padding."""
    B, hq, T, D = q.shape
    hkv = k.shape[1]
    g, blk = hq // hkv, ATTENTION_BLOCK
    tp = -(-T // blk) * blk
    slots = torch.arange(tp, device=q.device)
    if mask is None:
        allowed = (slots[None, :] <= slots[:, None]) if is_causal else torch.ones(tp, tp, dtype=torch.bool,
                                                                                 device=q.device)
        allowed = (allowed & (slots[None, :] < T)).view(1, 1, tp, tp)
    else:
        allowed = F.pad(mask.to(torch.bool), (0, tp - T, 0, tp - T))
    allowed = allowed | (slots[None, :] == slots[:, None]).view(1, 1, tp, tp)   # padded rows stay finite
    scale = 1.0 / math.sqrt(D)
    out = torch.empty(B, hq, T, D, dtype=q.dtype, device=q.device)
    rows = max(1, ATTENTION_BLOCK_BYTES // max(1, hq * blk * tp * q.element_size()))
    for r0 in range(0, B, rows):
        r1 = min(B, r0 + rows)
        n = r1 - r0
        qb = q[r0:r1].reshape(n, hkv, g, T, D)
        kb, vb = k[r0:r1], v[r0:r1]
        ab = allowed[r0:r1] if allowed.shape[0] > 1 else allowed
        for s0 in range(0, T, blk):
            end, stop = s0 + blk, min(s0 + blk, T)
            qs, ks, vs = qb[:, :, :, s0:stop], kb[:, :, :stop], vb[:, :, :stop]
            if stop < end:   # the last block: queries and keys padded to the block's end
                qs = F.pad(qs, (0, 0, 0, end - stop))
                ks, vs = F.pad(ks, (0, 0, 0, end - stop)), F.pad(vs, (0, 0, 0, end - stop))
            scores = torch.matmul(qs.reshape(n, hkv, g * blk, D), ks.transpose(-1, -2)) * scale   # [n, hkv, g*blk, end]
            scores = scores.view(n, hkv, g, blk, end)
            scores.masked_fill_(~ab[:, :, s0:end, :end].unsqueeze(1), float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(n, hkv, g * blk, end)
            y = torch.matmul(probs, vs).view(n, hkv, g, blk, D)[:, :, :, :stop - s0]
            out[r0:r1, :, s0:stop] = y.reshape(n, hq, stop - s0, D)
    return out


def attention_mask(t: int, key_valid: torch.Tensor | None, window: int | None,
                   device) -> tuple[torch.Tensor | None, bool]:
    """``(mask [B|1, 1, T, T] bool or None, is_causal)`` for a cache-free batch of ``T``
    tokens: causal, optionally windowed (a query sees keys less than ``window``
    positions back), restricted to valid keys. A query always sees itself, so padded
    query rows stay finite."""
    windowed = window is not None and t > window
    if key_valid is None and not windowed:
        return None, t > 1
    q_slot = torch.arange(t, device=device).unsqueeze(1)
    k_slot = torch.arange(t, device=device).unsqueeze(0)
    allowed = k_slot <= q_slot
    if windowed:
        allowed = allowed & (k_slot > q_slot - window)
    if key_valid is not None:
        allowed = (allowed.unsqueeze(0) & key_valid[:, None, :t]) | (k_slot == q_slot).unsqueeze(0)
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


# a dense tensor at least this large (in the runtime's dtype) that will live in the
# arena is read into it a slice of rows at a time, not read whole and then copied there
ARENA_DIRECT_BYTES = 16 << 20
ARENA_SLICE_BYTES = 16 << 20


def _stored_equal(dense, a: str, b: str) -> bool:
    """Whether two stored tensors are equal, compared a slice of rows at a time where the
    checkpoint reads slices (a vocabulary-sized pair is never held whole)."""
    if not hasattr(dense, "read_rows"):
        return torch.equal(dense[a], dense[b])
    ea, eb = dense.entry(a), dense.entry(b)
    if ea.dtype != eb.dtype or tuple(ea.shape) != tuple(eb.shape):
        return False
    if not ea.shape:
        return torch.equal(dense[a], dense[b])
    step = max(1, ARENA_SLICE_BYTES // max(1, math.prod(ea.shape[1:]) * ea.dtype.itemsize))
    return all(torch.equal(dense.read_rows(a, r, min(ea.shape[0], r + step)),
                           dense.read_rows(b, r, min(ea.shape[0], r + step))) for r in range(0, ea.shape[0], step))


class CheckpointTensors:
    """Fetches named tensors from a checkpoint, moved to device (floats cast to dtype).
    ``arena`` (a HugePageArena, or None): where :meth:`dense_in_arena` puts large tensors."""

    def __init__(self, ckpt, dtype: torch.dtype, device, arena=None):
        self.ckpt, self.dtype, self.device, self.arena = ckpt, dtype, torch.device(device), arena

    def dense(self, name: str, required: bool = True) -> torch.Tensor | None:
        t = self.ckpt.dense.get(name)
        if t is None:
            if required:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            return None
        return self.cast(t)

    def dense_in_arena(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as :meth:`dense` gives it, but a large float one straight in the
        arena, read and cast a slice of rows at a time: a vocabulary-sized head (fp32 from a
        bf16 file: 545 MB for Qwen2.5's) is then never held twice while it moves there."""
        dense = self.ckpt.dense
        if self.arena is None or not hasattr(dense, "read_rows") or name not in dense:
            return self.dense(name)
        e = dense.entry(name)
        if not e.dtype.is_floating_point or len(e.shape) != 2 or \
                math.prod(e.shape) * self.dtype.itemsize < ARENA_DIRECT_BYTES:
            return self.dense(name)
        out = self.arena.empty(e.shape, self.dtype)
        if out is None:
            return self.dense(name)
        step = max(1, ARENA_SLICE_BYTES // max(1, e.shape[1] * max(self.dtype.itemsize, e.dtype.itemsize)))
        for r in range(0, e.shape[0], step):
            out[r:r + step].copy_(dense.read_rows(name, r, min(e.shape[0], r + step)))
        return out

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, self.dtype if t.is_floating_point() else t.dtype)

    def linear(self, path: str, in_arena: bool = False) -> nn.Module:
        """The runtime layer for ``path`` (not yet prepared for a backend). ``in_arena``: a
        large dense weight is read straight into the arena (the head; not the projections,
        which q/k/v and gate/up fusing copies again)."""
        bias = self.dense(path + ".bias", required=False)
        qw = self.ckpt.quantized.get(path)
        if qw is None:
            weight = self.dense_in_arena(path + ".weight") if in_arena else self.dense(path + ".weight")
            layer = LAYER_CLASSES["dense"](weight, bias)
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
    arena = (HugePageArena() if huge_pages and kernels == "native" and torch.device(device).type == "cpu"
             and native_available("cpu") else None)
    tensors = CheckpointTensors(ckpt, dtype, device, arena)

    def prepared(module: nn.Module) -> nn.Module:
        """``module`` with its linears, norms and attention prepared for ``kernels`` and,
        with an ``arena``, its linears' streamed tensors moved to 2 MiB pages: done module
        by module as the model is built, so the tensors each step replaces are freed
        (and their pages given back, ``runtime/heap.py``) before the next module is read."""
        for m in module.modules():
            if isinstance(m, Int4Linear):
                if w4_activations == "int8" and torch.device(device).type == "cuda":
                    raise ValueError("w4_activations='int8' runs on the CPU kernels only; on CUDA the int4 "
                                     "layers take float16 / bfloat16 activations (w4_activations='float')")
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
        qk_norms = ({"q_norm": RMSNorm(tensors.dense(p + arch.q_norm + ".weight"), eps),
                     "k_norm": RMSNorm(tensors.dense(p + arch.k_norm + ".weight"), eps)} if arch.qk_norm else {})
        attn = Attention(*(tensors.linear(p + name)
                           for name in (arch.q_proj, arch.k_proj, arch.v_proj, arch.o_proj)),
                         n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, fuse=fuse, **qk_norms)
        mlp = MLP(*(tensors.linear(p + name) for name in (arch.gate_proj, arch.up_proj, arch.down_proj)),
                  fuse=fuse)
        layers.append(prepared(DecoderLayer(attn, mlp, RMSNorm(tensors.dense(p + arch.attn_norm + ".weight"), eps),
                                            RMSNorm(tensors.dense(p + arch.mlp_norm + ".weight"), eps), window)))

    tied = getattr(config, "tie_word_embeddings", False)
    head_name, embed_name = arch.lm_head + ".weight", arch.embed_tokens + ".weight"
    if tied and head_name in ckpt.dense and embed_name in ckpt.dense \
            and not _stored_equal(ckpt.dense, head_name, embed_name):
        tied = False    # stored apart with other values: transformers does not tie them either
    # a tied checkpoint that stores an equal head anyway: one copy, as transformers ties it;
    # one that stores only the head: that is the embedding. Where the head is the
    # embedding, it is read straight into the arena the head moves to (no second copy).
    head_is_embed = tied and arch.lm_head not in ckpt.quantized
    source = head_name if tied and embed_name not in ckpt.dense and head_name in ckpt.dense else embed_name
    embed = tensors.dense_in_arena(source) if head_is_embed else tensors.dense(source)
    if arch.lm_head in ckpt.quantized or (head_name in ckpt.dense and not tied):
        lm_head = prepared(tensors.linear(arch.lm_head, in_arena=True))
    elif tied:
        # the embedding is the head's weight: where the head moves, the embedding follows
        # (one copy, not the checkpoint's and the moved one)
        lm_head = prepared(LAYER_CLASSES["dense"](embed))
        embed = lm_head.weight.data
    else:
        raise KeyError(f"checkpoint has no {arch.lm_head!r} weight and tie_word_embeddings is false")
    norm = prepared(RMSNorm(tensors.dense(arch.final_norm + ".weight"), eps))
    model = LlamaFamilyModel(embed, layers, norm, lm_head, inverse_frequencies(config, head_dim),
                             max_seq_len, n_kv, head_dim)
    return model.eval()
