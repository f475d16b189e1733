"""The paged KV cache: ``k``, ``v`` of shape ``[n_layers, num_blocks, n_kv_heads,
block_size, head_dim]`` (int8: ``head_dim + 4``, each row followed by its scale,
``compress/ops/kv_int8.py``).

Position ``p`` of a sequence lives in block ``block_table[p // block_size]`` at offset
``p % block_size`` (its slot is ``block * block_size + offset``); the block manager
says which blocks a sequence holds. Per layer a block is one contiguous
``[n_kv_heads, block_size, head_dim]`` tile, so a decode step reads a row's keys block
by block.

On CPU the pool lives in 2 MiB pages (``hugepages.huge_page_zeros``): anonymous memory
starts zeroed and is committed only as slots are written, so a pool sized for every
row at full length costs address space, not memory, until sequences fill it (the block
manager hands out the lowest free blocks first, keeping what is touched compact).
"""
from __future__ import annotations

import os

import torch

from compress.dtypes import KV_CACHE_DTYPES
from compress.ops import kv_int8
from compress.runtime.hugepages import huge_page_zeros

# the default pool's cap, as a share of the machine's memory (CPU) or of the device's
# free memory (CUDA): a cache for every row at full length can be far larger
DEFAULT_MEMORY_SHARE = 0.5


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    t = huge_page_zeros(shape, dtype) if torch.device(device).type == "cpu" else None
    return torch.zeros(shape, dtype=dtype, device=device) if t is None else t


def resolve_kv_cache_dtype(dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for ``dtype`` (a name of ``KV_CACHE_DTYPES``, a torch
    dtype, or None / "model": ``model_dtype``, as ``compress bench`` names it); a
    ValueError naming the choices otherwise."""
    if dtype is None or dtype == "model":
        kv = model_dtype
    elif isinstance(dtype, torch.dtype):
        kv = dtype
    else:
        kv = KV_CACHE_DTYPES.get(str(dtype))
    if kv not in KV_CACHE_DTYPES.values():
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (or None / 'model': the model "
                         "dtype), "
                         f"got {dtype!r}")
    return kv


def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one position takes across all layers (int8: with its scales)."""
    return 2 * n_layers * n_kv_heads * kv_int8.row_elems(head_dim, dtype) * dtype.itemsize


def default_num_blocks(max_num_seqs: int, max_seq_len: int, block_size: int, token_bytes: int, device) -> int:
    """Blocks for ``max_num_seqs`` rows of ``max_seq_len`` positions, capped at
    ``DEFAULT_MEMORY_SHARE`` of the memory (the machine's on CPU, the device's free
    memory on CUDA), and never fewer than one full-length row."""
    want = max_num_seqs * -(-max_seq_len // block_size)
    device = torch.device(device)
    if device.type == "cuda":
        memory = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            memory = 16 << 30
    cap = int(memory * DEFAULT_MEMORY_SHARE) // (token_bytes * block_size)
    return max(min(want, cap), -(-max_seq_len // block_size))


class PagedKVCache:
    def __init__(self, n_layers: int, num_blocks: int, n_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device="cpu"):
        dtype = resolve_kv_cache_dtype(dtype, dtype)
        shape = (n_layers, num_blocks, n_kv_heads, block_size, kv_int8.row_elems(head_dim, dtype))
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        self.num_blocks, self.block_size = num_blocks, block_size
        # per-layer views made once (indexing costs ~3.5 us a call, 2 per layer per step)
        self._layers = [(self.k[i], self.v[i]) for i in range(n_layers)]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def prefault(self) -> None:
        """Touches every page of both pools now. The pools are mapped lazily (2 MiB pages
        where the OS gives them), so the first write to each page would otherwise fall
        in a decode step: a step that first reached a new stretch of blocks took 250 ms
        instead of 36 (the 345M model, 24 layers x K and V each faulting a page). A server
        pays that once at start."""
        self.k.zero_()
        self.v.zero_()

    @property
    def num_tokens(self) -> int:
        """Positions the pool holds."""
        return self.num_blocks * self.block_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s ``(k, v)`` pools, ``[num_blocks, n_kv_heads, block_size, head_dim]`` each."""
        return self._layers[i]
