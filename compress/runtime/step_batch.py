"""The batch descriptor of one engine step: every row's new tokens flattened into one
``[N]`` stream, and where each goes in the paged KV cache.

Rows ``0 .. num_decodes-1`` bring one token each (a decode, or a one-token chunk: the
same thing to attention); the rest are prefill chunks, each starting at any position.
A row's tokens take positions ``context_lens[r] - q_len .. context_lens[r] - 1``; no
padding anywhere. Built with a handful of tensor ops whatever the number of tokens.
"""
from __future__ import annotations

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


def block_table_tensor(tables: list[list[int]], device="cpu") -> torch.Tensor:
    """int32 ``[B, max len]``, each row padded with 0."""
    width = max((len(t) for t in tables), default=0) or 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)


def build_step_batch(tokens: list[list[int]], starts: list[int], tables: list[list[int]], block_size: int,
                     device="cpu") -> StepBatch:
    """The descriptor for rows that bring ``tokens[r]`` at positions ``starts[r] ..``,
    their blocks in ``tables[r]``. Rows with one token must come first."""
    q_lens = [len(t) for t in tokens]
    b = len(tokens)
    num_decodes = 0
    while num_decodes < b and q_lens[num_decodes] == 1:
        num_decodes += 1
    if any(n == 1 for n in q_lens[num_decodes:]) or any(n < 1 for n in q_lens):
        raise ValueError(f"rows must bring >= 1 token, one-token rows first; got {q_lens}")
    ids = torch.tensor(list(chain.from_iterable(tokens)), dtype=torch.int64)
    starts_t = torch.tensor(starts, dtype=torch.int64)
    query_start = torch.zeros(b + 1, dtype=torch.int64)
    if num_decodes == b:
        torch.arange(1, b + 1, out=query_start[1:])
        positions = starts_t
        row_of_token = torch.arange(b)
    else:
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=query_start[1:])
        row_of_token = torch.repeat_interleave(torch.arange(b), q_lens_t)
        positions = torch.arange(ids.shape[0]) - (query_start[:-1] - starts_t)[row_of_token]
    context = [s + n for s, n in zip(starts, q_lens)]
    block_tables = block_table_tensor(tables)
    block_idx = block_tables[row_of_token, positions // block_size].long()
    block_off = positions % block_size
    qs = query_start.tolist()
    prefill_rows = [PrefillRow(qs[r], qs[r + 1], starts[r], context[r],
                               block_tables[r, :-(-context[r] // block_size)].long().to(device))
                    for r in range(num_decodes, b)]
    dev = torch.device(device)
    return StepBatch(ids.to(dev), positions.to(dev), query_start.to(dev),
                     torch.tensor(context, dtype=torch.int32, device=dev),
                     (block_idx * block_size + block_off).to(dev), block_idx.to(dev), block_off.to(dev),
                     block_tables.to(dev), num_decodes, prefill_rows)
