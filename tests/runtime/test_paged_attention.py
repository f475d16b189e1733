"""Attention over the paged KV cache (the module path) against dense attention on the
same keys: one-token rows and prefill chunks starting anywhere, in one mixed step, at
odd lengths and block boundaries, shuffled blocks, GQA, windows, half-size caches."""
from __future__ import annotations

from array import array

import pytest
import torch

from compress.runtime.paged_attention import decode_attention_reference, paged_attention, write_kv
from compress.runtime.step_batch import build_step_batch

HKV, D = 2, 8


def dense_attention(q, k, v, positions, window):
    """``q [T, Hq, D]`` at ``positions`` over one row's ``k, v [S, Hkv, D]`` (positions
    0..S-1), causal and windowed, in float64."""
    hq = q.shape[1]
    kk = k.double().repeat_interleave(hq // k.shape[1], dim=1)
    vv = v.double().repeat_interleave(hq // v.shape[1], dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) / D ** 0.5
    kpos = torch.arange(k.shape[0])
    allowed = kpos[None, :] <= positions[:, None]
    if window:
        allowed &= kpos[None, :] > positions[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), vv)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("hq", [2, 8])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_step_matches_dense_attention(block_size, window, hq, cache_dtype):
    g = torch.Generator().manual_seed(block_size + window + hq)
    # (context before the step, new tokens): two one-token rows (one at a block's last slot,
    # one at a block's first) and prefill chunks from position 0 and from the middle
    rows = [(block_size - 1, 1), (2 * block_size, 1), (0, 3 * block_size + 5), (block_size + 1, 7),
            (0, 1 + 1)]
    lengths = [c + n for c, n in rows]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()   # blocks in shuffled order
    tables, used = [], 0
    for n in lengths:
        nb = -(-n // block_size)
        tables.append(perm[used:used + nb])
        used += nb
    k_pool = torch.zeros(num_blocks, HKV, block_size, D, dtype=cache_dtype)
    v_pool = torch.zeros_like(k_pool)
    full_k = [torch.randn(n, HKV, D, generator=g) for n in lengths]
    full_v = [torch.randn(n, HKV, D, generator=g) for n in lengths]
    # the context already in the cache
    for (c, _), table, k, v in zip(rows, tables, full_k, full_v):
        if c:
            pos = torch.arange(c)
            blk = torch.tensor(table)[pos // block_size]
            write_kv(k_pool, v_pool, k[:c], v[:c], blk, pos % block_size)
    batch = build_step_batch([list(range(n)) for _, n in rows], [c for c, _ in rows], tables, block_size)
    assert batch.num_decodes == 2 and batch.num_tokens == sum(n for _, n in rows)
    new_k = torch.cat([k[c:] for (c, _), k in zip(rows, full_k)])
    new_v = torch.cat([v[c:] for (c, _), v in zip(rows, full_v)])
    write_kv(k_pool, v_pool, new_k, new_v, batch.block_idx, batch.block_off)
    q = torch.randn(batch.num_tokens, hq, D, generator=g)
    got = paged_attention(q, new_k, new_v, k_pool, v_pool, batch, window, decode_attention_reference)
    qs = batch.query_start.tolist()
    for r, ((c, n), k, v) in enumerate(zip(rows, full_k, full_v)):
        k, v = k.to(cache_dtype), v.to(cache_dtype)  # what the cache holds
        want = dense_attention(q[qs[r]:qs[r + 1]], k, v, torch.arange(c, c + n), window)
        tol = 1e-5 if cache_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got[qs[r]:qs[r + 1]].double(), want, atol=tol, rtol=tol,
                                   msg=lambda m: f"row {r} (context {c}, {n} new): {m}")


def test_decode_op_matches_the_reference():
    """The op the runtime calls for one-token rows (native where built) and the
    reference agree."""
    from compress.runtime.paged_attention import decode_attention_op
    g = torch.Generator().manual_seed(0)
    k_pool, v_pool = torch.randn(12, HKV, 4, D, generator=g), torch.randn(12, HKV, 4, D, generator=g)
    tables = torch.tensor([[3, 7, 1, 0], [11, 2, 5, 9]], dtype=torch.int32)
    lens = torch.tensor([9, 16], dtype=torch.int32)
    q = torch.randn(2, 4, D, generator=g)
    for window in (0, 3):
        want = decode_attention_reference(q, k_pool, v_pool, tables, lens, window)
        for backend in ("native", "reference"):
            got = decode_attention_op(backend)(q, k_pool, v_pool, tables, lens, window)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_step_batch_descriptor():
    tables = [[5, 2], [7], [1, 4, 6]]
    batch = build_step_batch([[11], [12], [13, 14, 15, 16, 17]], [5, 0, 3], tables, 4)
    assert batch.positions.tolist() == [5, 0, 3, 4, 5, 6, 7]
    assert batch.query_start.tolist() == [0, 1, 2, 7]
    assert batch.context_lens.tolist() == [6, 1, 8] and batch.context_lens.dtype == torch.int32
    assert batch.block_tables.tolist() == [[5, 2, 0], [7, 0, 0], [1, 4, 6]]
    assert batch.slot_mapping.tolist() == [2 * 4 + 1, 7 * 4 + 0, 1 * 4 + 3, 4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3]
    assert batch.num_decodes == 2 and len(batch.prefill_rows) == 1
    row = batch.prefill_rows[0]
    assert (row.q_start, row.q_end, row.start, row.context, row.blocks.tolist()) == (2, 7, 3, 8, [1, 4])
    assert batch.last_token_index().tolist() == [0, 1, 6]
    with pytest.raises(ValueError, match="one-token rows first"):
        build_step_batch([[1, 2], [3]], [0, 0], [[0], [1]], 4)


def test_one_token_step_descriptor():
    """A step of one-token rows only (its fields views of one buffer) describes what the
    general construction does: the rows of the mixed step above, without the chunk."""
    tables = [array("i", [5, 2]), [7]]
    batch = build_step_batch([[11], [12]], [5, 0], tables, 4)
    fields = {"token_ids": [11, 12], "positions": [5, 0], "query_start": [0, 1, 2], "context_lens": [6, 1],
              "slot_mapping": [9, 28], "block_idx": [2, 7], "block_off": [1, 0], "block_tables": [[5, 2], [7, 0]]}
    for name, want in fields.items():
        got = getattr(batch, name)
        assert got.tolist() == want and got.is_contiguous(), name
    assert batch.token_ids.dtype == batch.slot_mapping.dtype == torch.int64 and batch.context_lens.dtype == torch.int32
    assert batch.num_decodes == 2 and batch.prefill_rows == [] and batch.last_token_index().tolist() == [0, 1]


def test_sdpa_masks_are_causal_from_the_chunk_start():
    from compress.runtime.paged_attention import chunk_mask
    assert chunk_mask(0, 5, 5, None, "cpu") is None                  # plain causal
    m = chunk_mask(3, 2, 5, None, "cpu")
    assert m.tolist() == [[True] * 4 + [False], [True] * 5]
    w = chunk_mask(3, 2, 5, 2, "cpu")
    assert w.tolist() == [[False, False, True, True, False], [False, False, False, True, True]]
