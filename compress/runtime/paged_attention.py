"""Attention over the paged KV cache (``kv_cache.py``), as pure tensor functions.

* ``write_kv``: the step's new keys and values into their slots.
* ``decode_attention_op``: one query per row over that row's blocks, the op
  ``compress::paged_decode_attention`` (``decode_attention_reference`` where the op
  library has none).
* ``chunk_attention``: the queries of a prefill chunk that starts at any position, over
  the row's keys gathered from its blocks, causal (and windowed).

Windows: a query at position ``p`` sees keys ``p - window + 1 .. p`` (``window`` 0 or
``None``: all of ``0 .. p``). Keys and values are converted to the queries' dtype for
the products (a float16 or bfloat16 cache under float32 activations); an int8 cache's
rows are quantized when written and read back as ``float(q) * scale``
(``compress/ops/kv_int8.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from compress.ops import get_op, kv_int8, library


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             block_idx: torch.Tensor, block_off: torch.Tensor) -> None:
    """``k``, ``v`` ``[N, Hkv, D]`` into one layer's pools ``[NB, Hkv, BS, D]`` at each
    token's block and offset (int64 ``[N]``), converted to the pool's dtype (int8:
    quantized rows)."""
    k_pool[block_idx, :, block_off] = kv_int8.to_pool(k, k_pool.dtype)
    v_pool[block_idx, :, block_off] = kv_int8.to_pool(v, v_pool.dtype)


def gather_context(pool: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """Positions ``0 .. length-1`` of one row from a layer's pool ``[NB, Hkv, BS, D]``
    given its blocks (int64 ``[nb]``, in order): ``[Hkv, length, D]``."""
    tiles = pool.index_select(0, blocks)                       # [nb, Hkv, BS, D]
    nb, hkv, bs, d = tiles.shape
    return tiles.transpose(0, 1).reshape(hkv, nb * bs, d)[:, :length]


def decode_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, window: int) -> torch.Tensor:
    """``q [B, Hq, D]``: row ``r``'s query sees its keys ``0 .. context_lens[r]-1`` (the
    last ``window`` of them when ``window`` > 0) through ``block_tables [B, M]``; GQA
    (query head h reads kv head h // (Hq / Hkv)), scale 1/sqrt(D). ``[B, Hq, D]``."""
    b, hq, d = q.shape
    bs = k_pool.shape[2]
    out = torch.empty_like(q)
    for r, n in enumerate(context_lens.tolist()):
        blocks = block_tables[r, :-(-n // bs)].long()
        k, v = gather_context(k_pool, blocks, n), gather_context(v_pool, blocks, n)
        if window and n > window:
            k, v = k[:, n - window:], v[:, n - window:]
        y = F.scaled_dot_product_attention(q[r].unsqueeze(1).unsqueeze(0), kv_int8.from_pool(k, q.dtype).unsqueeze(0),
                                           kv_int8.from_pool(v, q.dtype).unsqueeze(0), enable_gqa=hq != k.shape[0])
        out[r] = y[0, :, 0]
    return out


def decode_attention_op(backend: str):
    """``(q, k_pool, v_pool, block_tables, context_lens, window) -> [B, Hq, D]``: the
    ``paged_decode_attention`` op for ``backend``, or the reference above where the op
    library does not define it."""
    if "paged_decode_attention" in library.SCHEMAS:
        return get_op("paged_decode_attention", backend)
    return decode_attention_reference


def chunk_mask(start: int, length: int, context: int, window: int | None, device) -> torch.Tensor | None:
    """``[T, S]`` bool (True = may attend) for queries at positions ``start .. start+T-1``
    over keys ``0 .. S-1``; ``None`` where plain causal attention (``is_causal``) is it."""
    windowed = bool(window) and context > window
    if start == 0 and not windowed and length == context:
        return None
    q_pos = torch.arange(start, start + length, device=device).unsqueeze(1)
    k_pos = torch.arange(context, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if windowed:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``q [T, Hq, D]`` over ``k, v [Hkv, S, D]`` (pool rows of any K / V dtype) with
    ``mask`` from ``chunk_mask`` (``None``: causal, T == S): ``[T, Hq, D]``."""
    qh = q.transpose(0, 1).unsqueeze(0)
    k, v = kv_int8.from_pool(k, q.dtype), kv_int8.from_pool(v, q.dtype)
    y = F.scaled_dot_product_attention(qh, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                       is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[0])
    return y[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    batch, window: int | None, decode_op) -> torch.Tensor:
    """Attention of one layer for a step (``step_batch.StepBatch``) whose new keys and
    values ``k, v [N, Hkv, D]`` are already in the pools: the one-token rows in one
    ``decode_op`` call, each prefill chunk over its gathered context. ``q [N, Hq, D]``
    -> ``[N, Hq, D]``. A chunk that starts at position 0 reads its own new keys (rounded
    to the pool's dtype, or quantized, as the pool holds them) instead of gathering them
    back."""
    parts = []
    nd = batch.num_decodes
    if nd:
        parts.append(decode_op(q[:nd], k_pool, v_pool, batch.block_tables[:nd], batch.context_lens[:nd],
                               window or 0))
    for i, row in enumerate(batch.prefill_rows):
        if row.start == 0:
            kk = kv_int8.to_pool(k[row.q_start:row.q_end], k_pool.dtype).transpose(0, 1)
            vv = kv_int8.to_pool(v[row.q_start:row.q_end], v_pool.dtype).transpose(0, 1)
        else:
            kk = gather_context(k_pool, row.blocks, row.context)
            vv = gather_context(v_pool, row.blocks, row.context)
        parts.append(chunk_attention(q[row.q_start:row.q_end], kk, vv, batch.mask(i, window)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
