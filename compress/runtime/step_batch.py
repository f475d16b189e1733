"""The batch descriptor of one engine step: every row's new tokens flattened into one
``[N]`` stream, and where each goes in the paged KV cache.

Rows ``0 .. num_decodes-1`` bring one token each (a decode, or a one-token chunk: the
same thing to attention); the rest are prefill chunks, each starting at any position.
A row's tokens take positions ``context_lens[r] - q_len .. context_lens[r] - 1``; no
padding anywhere. Built with a handful of tensor ops whatever the number of tokens.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import chain

import torch

from compress.runtime.paged_attention import chunk_mask


@dataclass
class PrefillRow:
    q_start: int      # its tokens in the flattened stream: [q_start, q_end)
    q_end: int
    start: int        # position of its first new token
    context: int      # positions 0 .. context-1 are attended (after this step)
    blocks: torch.Tensor  # int64 [ceil(context / block_size)]: its blocks in order


@dataclass
class StepBatch:
    token_ids: torch.Tensor      # int64 [N]
    positions: torch.Tensor      # int64 [N]
    query_start: torch.Tensor    # int64 [B+1]: row r's tokens are [query_start[r], query_start[r+1])
    context_lens: torch.Tensor   # int32 [B]: positions each row attends after this step
    slot_mapping: torch.Tensor   # int64 [N]: block * block_size + offset of each token
    block_idx: torch.Tensor      # int64 [N]: slot_mapping // block_size
    block_off: torch.Tensor      # int64 [N]: slot_mapping % block_size
    block_tables: torch.Tensor   # int32 [B, M], rows padded with 0
    num_decodes: int
    prefill_rows: list[PrefillRow]
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def num_rows(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    def last_token_index(self) -> torch.Tensor:
        """int64 ``[B]``: each row's last token in the flattened stream."""
        return self.query_start[1:] - 1

    def mask(self, i: int, window: int | None) -> torch.Tensor | None:
        """Prefill row ``i``'s attention mask for a layer with ``window`` (made once a step)."""
        key = (i, window)
        if key not in self._masks:
            row = self.prefill_rows[i]
            self._masks[key] = chunk_mask(row.start, row.q_end - row.q_start, row.context, window,
                                          self.token_ids.device)
        return self._masks[key]


def block_table_tensor(tables, device="cpu") -> torch.Tensor:
    """int32 ``[B, max len]`` of the rows' block ids (``array('i')`` or lists), each row
    padded with 0: one copy per row into one buffer."""
    width = max((len(t) for t in tables), default=0) or 1
    buf = array("i", bytes(4 * width * len(tables)))
    for r, t in enumerate(tables):
        buf[r * width:r * width + len(t)] = t if isinstance(t, array) else array("i", t)
    out = torch.frombuffer(buf, dtype=torch.int32).view(len(tables), width) if tables else \
        torch.zeros((0, 1), dtype=torch.int32)
    return out.to(device) if torch.device(device).type != "cpu" else out


def build_step_batch(tokens: list[list[int]], starts: list[int], tables, block_size: int,
                     device="cpu") -> StepBatch:
    """The descriptor for rows that bring ``tokens[r]`` at positions ``starts[r] ..``,
    their blocks in ``tables[r]``. Rows with one token must come first. One-token rows
    are placed with a few Python ints each; a prefill chunk with tensor ops (no loop
    over its tokens)."""
    q_lens = [len(t) for t in tokens]
    b = len(tokens)
    nd = 0
    while nd < b and q_lens[nd] == 1:
        nd += 1
    if any(n == 1 for n in q_lens[nd:]) or any(n < 1 for n in q_lens):
        raise ValueError(f"rows must bring >= 1 token, one-token rows first; got {q_lens}")
    dec_pos = starts[:nd]
    if nd == b > 0:
        return _one_token_batch([t[0] for t in tokens], dec_pos, tables, block_size, device)
    dec_blk, dec_off, _, context = one_token_fields(dec_pos, tables, block_size)
    positions = torch.tensor(dec_pos, dtype=torch.int64)
    block_idx = torch.tensor(dec_blk, dtype=torch.int64)
    block_off = torch.tensor(dec_off, dtype=torch.int64)
    query_start = list(range(nd + 1))
    prefill_rows = []
    if nd < b:
        pos_parts, blk_parts, off_parts = [positions], [block_idx], [block_off]
        for r in range(nd, b):
            start, n = starts[r], q_lens[r]
            ctx = start + n
            blocks = torch.tensor(tables[r][:-(-ctx // block_size)], dtype=torch.int64)
            pos = torch.arange(start, ctx)
            pos_parts.append(pos)
            blk_parts.append(blocks[pos // block_size])
            off_parts.append(pos % block_size)
            prefill_rows.append(PrefillRow(query_start[-1], query_start[-1] + n, start, ctx, blocks.to(device)))
            query_start.append(query_start[-1] + n)
            context.append(ctx)
        positions, block_idx, block_off = torch.cat(pos_parts), torch.cat(blk_parts), torch.cat(off_parts)
    ids = torch.tensor(tokens[0] if b == 1 else list(chain.from_iterable(tokens)), dtype=torch.int64)
    dev = torch.device(device)
    return StepBatch(ids.to(dev), positions.to(dev), torch.tensor(query_start, dtype=torch.int64, device=dev),
                     torch.tensor(context, dtype=torch.int32, device=dev),
                     (block_idx * block_size + block_off).to(dev), block_idx.to(dev), block_off.to(dev),
                     block_table_tensor(tables, dev), nd, prefill_rows)


def one_token_fields(positions: list[int], tables, block_size: int):
    """Block index, offset in the block, slot and context length of one-token rows at
    ``positions`` with block tables ``tables`` (Python ints, four lists)."""
    blocks = [t[p // block_size] for t, p in zip(tables, positions)]
    offsets = [p % block_size for p in positions]
    return blocks, offsets, [x * block_size + o for x, o in zip(blocks, offsets)], [p + 1 for p in positions]


def _one_token_batch(ids: list[int], positions: list[int], tables, block_size: int, device) -> StepBatch:
    """``build_step_batch`` of one-token rows only (a decode step): the int64 fields are
    views of one buffer made from one array of Python ints (one copy to the device)."""
    b = len(ids)
    blocks, offsets, slots, context = one_token_fields(positions, tables, block_size)
    flat = torch.frombuffer(array("q", [*ids, *positions, *blocks, *offsets, *slots, *range(b + 1)]),
                            dtype=torch.int64)
    context = torch.frombuffer(array("i", context), dtype=torch.int32)
    dev = torch.device(device)
    if dev.type != "cpu":
        flat, context = flat.to(dev), context.to(dev)
    ids_t, pos_t, blk_t, off_t, slot_t = flat[:5 * b].view(5, b)
    return StepBatch(ids_t, pos_t, flat[5 * b:], context, slot_t, blk_t, off_t, block_table_tensor(tables, dev),
                     b, [])
