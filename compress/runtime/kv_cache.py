"""Preallocated contiguous KV cache: ``[layers, batch, kv_heads, max_len, head_dim]``.

Allocated once and reused while a request batch fits; a decode step only writes one
slot per layer. Rows of finished sequences are dropped by compacting the batch
dimension in place (``keep``), so the live batch is always ``[:batch]``.

On CPU the cache lives in 2 MiB pages (``hugepages.huge_page_zeros``): attention reads
every layer's slices once per step, and anonymous memory starts zeroed and is only
committed as slots are written.
"""
from __future__ import annotations

import torch

from compress.runtime.hugepages import huge_page_zeros


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    t = huge_page_zeros(shape, dtype) if torch.device(device).type == "cpu" else None
    return torch.zeros(shape, dtype=dtype, device=device) if t is None else t


class KVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device="cpu"):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        self.batch = batch
        # per-layer views made once (indexing costs ~3.5 us a call, 2 per layer per step)
        self._layers = [(self.k[i], self.v[i]) for i in range(n_layers)]

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, slots) this cache can hold."""
        return self.k.shape[1], self.k.shape[3]

    def fits(self, batch: int, max_len: int, dtype: torch.dtype) -> bool:
        rows, slots = self.capacity
        return batch <= rows and max_len <= slots and dtype == self.k.dtype

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def keep(self, rows: list[int], length: int) -> None:
        """Keep only batch rows ``rows`` (in that order) in the first ``len(rows)`` rows;
        only the first ``length`` slots are copied."""
        idx = torch.as_tensor(rows, device=self.k.device)
        n = len(rows)
        self.k[:, :n, :, :length] = self.k[:, idx, :, :length]
        self.v[:, :n, :, :length] = self.v[:, idx, :, :length]
        self.batch = n
