"""Decode steps on a GPU replayed from CUDA graphs.

A decode step of the module path launches some ten kernels a layer, and each launch
costs the host more than the kernel costs the GPU at small batches: a 16-layer model
decodes at a few percent of its bandwidth limit. ``DecodeGraphs`` captures the whole
decode step (embedding, every layer with its KV write and paged attention, final norm,
LM head) once per batch bucket, over static input buffers, and a step then costs a
few host-to-device copies and one graph launch.

* Buckets: 1, 2, 4, 8, then every 8 up to ``max_batch``; a step of ``n`` rows runs the
  smallest bucket >= n. Rows ``n ..`` of the bucket repeat row 0 (same token, position,
  slot and blocks): they write row 0's key and value into row 0's slot again, and their
  logits are dropped.
* The block tables are ``ceil(max_seq_len / block_size)`` wide; the attention kernel
  reads only the entries a row's length needs.
* Captured at engine start, before any sequence holds a block: the warm-up pass of each
  capture writes keys and values into block 0, which no sequence owns yet.
* Only steps whose rows all bring one token and all want their logits (plain decode
  steps) replay; prompt chunks and speculative verification run the module path.

``capture`` is the CUDA one; the tests pass ``capture_eager`` (the same buffers and
batches, the function re-run instead of replayed) to check the plumbing on a CPU."""
from __future__ import annotations

import torch

from compress.runtime.step_batch import StepBatch, block_table_tensor


def capture_cuda(fn, pool):
    """``(replay, out)``: ``fn`` captured into a CUDA graph (after one warm-up run on a
    side stream, as capture requires); ``replay()`` reruns it into the static ``out``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out


def capture_eager(fn, pool=None):
    """The CPU stand-in for ``capture_cuda``: ``replay()`` runs ``fn`` again into ``out``."""
    out = fn()
    return (lambda: out.copy_(fn())), out


def batch_buckets(max_batch: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 8)) + [max_batch]


class DecodeGraphs:
    """The decode step of ``model`` over ``kv_cache``, captured per batch bucket up to
    ``max_batch`` rows (see the module docstring)."""

    def __init__(self, model, kv_cache, max_batch: int, capture=None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.kv_cache = model, kv_cache
        self.max_batch = max_batch
        self.buckets = batch_buckets(max_batch)
        dev = model.device
        bs = kv_cache.block_size
        self.width = -(-model.max_seq_len // bs)
        with torch.inference_mode():
            # token ids, positions, block index, offset in the block, slot
            self.ints = torch.zeros((5, max_batch), dtype=torch.int64, device=dev)
            self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
            self.block_tables = torch.zeros((max_batch, self.width), dtype=torch.int32, device=dev)
            self.query_start = torch.arange(max_batch + 1, dtype=torch.int64, device=dev)
        capture = capture or capture_cuda
        pool = torch.cuda.graph_pool_handle() if capture is capture_cuda else None
        self.graphs: dict[int, tuple] = {}
        self.replays = 0
        with torch.inference_mode():
            for b in sorted(self.buckets, reverse=True):   # the largest first: the others reuse its memory
                batch = self._batch(b)
                self.graphs[b] = capture(lambda batch=batch: model.logits(model.forward_paged(batch, kv_cache)),
                                         pool)

    def _batch(self, b: int) -> StepBatch:
        ids, pos, blk, off, slot = self.ints[:, :b]
        return StepBatch(ids, pos, self.query_start[:b + 1], self.context_lens[:b], slot, blk, off,
                         self.block_tables[:b], b, [])

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def decode(self, tokens: list[int], positions: list[int], tables: list) -> torch.Tensor:
        """fp32 logits ``[n, V]`` of ``n`` one-token rows: row r brings ``tokens[r]`` at
        ``positions[r]`` with its blocks ``tables[r]`` (long enough for the position)."""
        n = len(tokens)
        b = self.bucket(n)
        if b is None or n == 0:
            raise ValueError(f"a graph decode step takes 1..{self.max_batch} rows, got {n}")
        if any(len(t) > self.width for t in tables):
            raise ValueError(f"a block table is longer than the graphs' {self.width} blocks")
        pad = b - n
        bs = self.kv_cache.block_size
        tokens = list(tokens) + [tokens[0]] * pad
        positions = list(positions) + [positions[0]] * pad
        blk = [tables[r][p // bs] for r, p in enumerate(positions[:n])]
        blk += [blk[0]] * pad
        off = [p % bs for p in positions]
        host = torch.tensor([tokens, positions, blk, off, [x * bs + o for x, o in zip(blk, off)]], dtype=torch.int64)
        self.ints[:, :b].copy_(host)
        self.context_lens[:b].copy_(torch.tensor([p + 1 for p in positions], dtype=torch.int32))
        table = block_table_tensor(list(tables) + [tables[0]] * pad)
        self.block_tables[:b, :table.shape[1]].copy_(table)
        replay, out = self.graphs[b]
        replay()
        self.replays += 1
        return out[:n].clone()
