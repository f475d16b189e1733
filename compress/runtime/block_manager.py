"""The pool of KV cache blocks: which block holds which positions of which sequence.

A block holds ``block_size`` consecutive positions of one sequence (position ``p`` of a
sequence lives in block ``block_table[p // block_size]`` at offset ``p % block_size``).
Blocks are reference counted: a full block whose tokens two sequences share (the same
prefix) is held by both.

Prefix caching: once a block is full of computed tokens it is registered under a hash
chained over its token ids and the previous block's hash, so equal hashes mean equal
prefixes. A new sequence whose leading full blocks are registered takes them (refcount
+ 1) and skips computing them. A freed block keeps its hash and stays findable until it
is handed out again: free blocks without a hash are handed out first (lowest id first, so
the memory the cache commits stays near the peak in use), then registered ones, least
recently freed first (a sequence's blocks are freed last block first, so a chain's tail
goes before its head). The last token of a sequence is never taken from the cache (its
logits are needed), so a hit covers at most the full blocks before it.
"""
from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict

from compress.runtime.sequence import Sequence

ROOT_HASH = 0x9E3779B97F4A7C15  # the "previous block" of a sequence's first block


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one KV block of at least one token, got num_blocks={num_blocks}, "
                             f"block_size={block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks     # registered content of each block
        self.keys: list[tuple | None] = [None] * num_blocks      # (parent hash, tokens): checked on a hit
        self.cached: dict[int, int] = {}                         # hash -> block id
        self.free_plain: list[int] = list(range(num_blocks))     # a heap: free blocks without a hash
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # free registered blocks, LRU first
        self.hit_tokens = 0     # prompt tokens found in the cache
        self.query_tokens = 0   # prompt tokens looked up

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence holds (free registered blocks are not in use)."""
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The hashes of ``seq``'s first ``num_blocks`` full blocks (computed once each)."""
        hashes, bs, tokens = seq.block_hashes, self.block_size, seq.token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else ROOT_HASH, tuple(tokens[i * bs:(i + 1) * bs])))
        return hashes

    def _key(self, seq: Sequence, i: int) -> tuple:
        bs = self.block_size
        return (seq.block_hashes[i - 1] if i else ROOT_HASH, tuple(seq.token_ids[i * bs:(i + 1) * bs]))

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The registered blocks holding ``seq``'s leading full blocks (all but its last
        token), in order; empty without prefix caching."""
        if not self.enable_prefix_caching:
            return []
        n = (seq.num_tokens - 1) // self.block_size
        hits = []
        for i, h in enumerate(self._hashes(seq, n)):
            b = self.cached.get(h)
            if b is None or self.keys[b] != self._key(seq, i):
                break
            hits.append(b)
        return hits

    def register_full_blocks(self, seq: Sequence) -> None:
        """Registers the blocks of ``seq`` that are now full of computed tokens. A block
        whose content another block already holds (two equal prompts computed side by
        side) stays unregistered."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            b = seq.block_table[i]
            if hashes[i] not in self.cached and self.hashes[b] is None:
                self.cached[hashes[i]] = b
                self.hashes[b] = hashes[i]
                self.keys[b] = self._key(seq, i)
        seq.num_registered_blocks = full

    def reset_prefix_cache(self) -> int:
        """Forgets every free registered block (they become plain free blocks); blocks in
        use stay registered. Returns how many were forgotten."""
        n = len(self.free_cached)
        for b in self.free_cached:
            del self.cached[self.hashes[b]]
            self.hashes[b] = self.keys[b] = None
            heapq.heappush(self.free_plain, b)
        self.free_cached.clear()
        return n

    # ------------------------------------------------------------------ allocation
    def can_allocate(self, hits: list[int], num_tokens: int) -> bool:
        """Whether a waiting sequence can take the cached blocks ``hits`` and fresh blocks
        for the rest of its first ``num_tokens`` positions."""
        fresh = self.blocks_for(num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)  # free now: taken from the pool
        return fresh + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> None:
        """Admits ``seq``: its block table starts with the cached blocks ``hits`` (their
        positions count as computed) and grows to hold ``num_new_tokens`` more."""
        assert not seq.block_table, f"request {seq.request_id!r} already holds blocks"
        for b in hits:
            if self.ref_counts[b] == 0:
                del self.free_cached[b]
            self.ref_counts[b] += 1
        seq.block_table = array("i", hits)
        seq.num_registered_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.query_tokens += seq.num_tokens
            self.hit_tokens += seq.num_computed_tokens
        self.append_slots(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grows ``seq``'s block table to hold ``num_new_tokens`` positions past the
        computed ones (call ``can_append`` first)."""
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._take())

    def trim(self, seq: Sequence) -> None:
        """Gives back the blocks past those ``seq``'s tokens need (after a speculative
        step kept fewer tokens than it reserved positions for)."""
        keep = self.blocks_for(seq.num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def _release(self, b: int) -> None:
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            if self.hashes[b] is not None:
                self.free_cached[b] = None
            else:
                heapq.heappush(self.free_plain, b)

    def _take(self) -> int:
        if self.free_plain:
            b = heapq.heappop(self.free_plain)
        elif self.free_cached:
            b, _ = self.free_cached.popitem(last=False)  # evict the least recently freed
            del self.cached[self.hashes[b]]
            self.hashes[b] = self.keys[b] = None
        else:
            raise RuntimeError("no free KV block (the scheduler checks before it allocates)")
        self.ref_counts[b] = 1
        return b

    def free(self, seq: Sequence) -> None:
        """Gives back ``seq``'s blocks, its last block first."""
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table = array("i")
        seq.num_registered_blocks = 0
