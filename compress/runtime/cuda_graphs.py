"""Decode steps on a GPU replayed from CUDA graphs.

A decode step of the module path launches some ten kernels a layer, and each launch
costs the host more than the kernel costs the GPU at small batches: a 16-layer model
decodes at a few percent of its bandwidth limit. ``DecodeGraphs`` captures the whole
decode step (embedding, every layer with its KV write and paged attention, final norm,
LM head) once per batch bucket, over static input buffers, and a step then costs a
at most two host-to-device copies and one graph launch.

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

from array import array

import torch

from compress.runtime.step_batch import StepBatch, one_token_fields


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


class _BucketInputs:
    """One bucket's static inputs, on the device (the graph reads them) and in host memory
    (a step writes them there, then copies them over): token ids, positions, block index,
    offset in the block and slot (int64 ``[5, b]``) and the context lengths (int32
    ``[b]``) back to back in one buffer, one copy; the block tables (int32 ``[b, width]``)
    in another, of which a step copies the columns its longest table fills, and only when a
    table changed since the bucket's last step (a decode step's tables grow a block every
    ``block_size`` tokens)."""

    def __init__(self, b: int, width: int, device):
        self.b = b
        nbytes = -(-44 * b // 8) * 8
        self.device = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.ints = self.device[:40 * b].view(torch.int64).view(5, b)
        self.context_lens = self.device[40 * b:44 * b].view(torch.int32)
        self.context_lens.fill_(1)   # a capture's rows attend to one position
        self.block_tables = torch.zeros((b, width), dtype=torch.int32, device=device)
        self.host_bytes = bytearray(nbytes)
        self.host = torch.frombuffer(self.host_bytes, dtype=torch.uint8)
        self.host_int64 = memoryview(self.host_bytes).cast("q")
        self.host_int32 = memoryview(self.host_bytes).cast("i")
        self.host_table_bytes = bytearray(4 * b * width)
        self.host_tables = torch.frombuffer(self.host_table_bytes, dtype=torch.int32).view(b, width)
        self.host_table_words = memoryview(self.host_table_bytes).cast("i")
        self.tables: list[array] | None = None   # copies of the tables the device holds

    def fill(self, ints: array, context_lens: array, tables: list, used_width: int) -> None:
        """Writes the step's rows (``ints``: the five int64 rows back to back; ``tables``:
        ``b`` block tables, none longer than ``used_width``) and copies them to the
        device. A table's entries past its length keep what they held: the kernels read
        only those a row's length needs."""
        b = self.b
        self.host_int64[:5 * b] = ints
        self.host_int32[10 * b:11 * b] = context_lens
        self.device.copy_(self.host)
        if tables == self.tables:   # as the last step of this bucket left them on the device
            return
        words, width = self.host_table_words, self.host_tables.shape[1]
        at = 0
        for t in tables:
            words[at:at + len(t)] = t if isinstance(t, array) else array("i", t)
            at += width
        self.block_tables[:, :used_width].copy_(self.host_tables[:, :used_width])
        self.tables = [array("i", t) for t in tables]


class DecodeGraphs:
    """The decode step of ``model`` over ``kv_cache``, captured per batch bucket up to
    ``max_batch`` rows (see the module docstring). Each bucket has its own input buffers
    (``_BucketInputs``): a step is at most two host-to-device copies and one replay."""

    def __init__(self, model, kv_cache, max_batch: int, capture=None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.kv_cache = model, kv_cache
        self.max_batch = max_batch
        self.buckets = batch_buckets(max_batch)
        self._bucket_of = [None] + [next(b for b in self.buckets if b >= n) for n in range(1, max_batch + 1)]
        dev = model.device
        bs = kv_cache.block_size
        self.width = -(-model.max_seq_len // bs)
        with torch.inference_mode():
            self.inputs = {b: _BucketInputs(b, self.width, dev) for b in self.buckets}
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
        inputs = self.inputs[b]
        ids, pos, blk, off, slot = inputs.ints
        return StepBatch(ids, pos, self.query_start[:b + 1], inputs.context_lens, slot, blk, off,
                         inputs.block_tables, b, [])

    def bucket(self, n: int) -> int | None:
        return self._bucket_of[n] if 0 < n <= self.max_batch else None

    def decode(self, tokens: list[int], positions: list[int], tables: list) -> torch.Tensor:
        """fp32 logits ``[n, V]`` of ``n`` one-token rows: row r brings ``tokens[r]`` at
        ``positions[r]`` with its blocks ``tables[r]`` (long enough for the position).
        The logits are a view of the graph's output: the next ``decode`` overwrites them."""
        n = len(tokens)
        b = self.bucket(n)
        if b is None:
            raise ValueError(f"a graph decode step takes 1..{self.max_batch} rows, got {n}")
        used_width = max(map(len, tables))
        if used_width > self.width:
            raise ValueError(f"a block table is longer than the graphs' {self.width} blocks")
        blk, off, slot, context = one_token_fields(positions, tables, self.kv_cache.block_size)
        pad = b - n
        if pad:
            tokens, positions, blk, off, slot, context = [v + [v[0]] * pad for v in
                                                          (list(tokens), list(positions), blk, off, slot, context)]
            tables = list(tables) + [tables[0]] * pad
        self.inputs[b].fill(array("q", [*tokens, *positions, *blk, *off, *slot]), array("i", context), tables,
                            used_width)
        replay, out = self.graphs[b]
        replay()
        self.replays += 1
        return out[:n]
