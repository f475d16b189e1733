"""The KV block pool: reference counts, lowest-free-first allocation, prefix caching by
hash-chained full blocks (hits, misses, LRU reuse of freed blocks), reset."""
from __future__ import annotations

import pytest

from compress.runtime.block_manager import BlockManager
from compress.runtime.sampling import SamplingParams
from compress.runtime.sequence import Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, None, list(tokens), SamplingParams(), set())


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    hits = bm.cached_prefix(s)
    n = s.num_tokens - len(hits) * bm.block_size
    assert bm.can_allocate(hits, s.num_tokens)
    bm.allocate(s, hits, n)
    s.num_computed_tokens = s.num_tokens
    bm.register_full_blocks(s)
    return hits


def test_allocate_append_free_counts():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = seq(range(10))
    bm.allocate(a, [], 10)
    assert list(a.block_table) == [0, 1, 2] and bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    a.num_computed_tokens = 10
    assert bm.can_append(a, 2) and bm.blocks_for(12) == 3
    bm.append_slots(a, 2)                      # positions 10, 11 fit block 2
    assert list(a.block_table) == [0, 1, 2]
    bm.append_slots(a, 3)                      # 13 positions: a fourth block
    assert list(a.block_table) == [0, 1, 2, 3]
    b = seq(range(3), "b")
    bm.allocate(b, [], 3)
    assert list(b.block_table) == [4]
    bm.free(a)
    assert list(a.block_table) == [] and bm.num_used_blocks == 1
    c = seq(range(5), "c")
    bm.allocate(c, [], 5)
    assert list(c.block_table) == [0, 1]             # the lowest free blocks first
    assert not bm.can_allocate([], 4 * 7) and bm.can_allocate([], 4 * 5)


def test_prefix_hit_shares_full_blocks_and_never_the_last_token():
    bm = BlockManager(16, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert admit(bm, a) == []
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 99])
    assert admit(bm, b) == list(a.block_table[:2])   # two full blocks shared
    assert bm.ref_counts[a.block_table[0]] == 2 and b.num_computed_tokens == 9
    assert bm.hit_tokens == 8 and bm.query_tokens == 19
    exact = seq([1, 2, 3, 4, 5, 6, 7, 8], "exact")  # its last token must be computed: one block only
    assert bm.cached_prefix(exact) == list(a.block_table[:1])
    shifted = seq([0, 1, 2, 3, 4, 5, 6, 7, 8], "shifted")  # same tokens at other positions: no hit
    assert bm.cached_prefix(shifted) == []
    second_only = seq([9, 9, 9, 9, 5, 6, 7, 8, 1], "2nd")  # the second block equal, its prefix not
    assert bm.cached_prefix(second_only) == []


def test_freed_blocks_stay_cached_until_reused_lru_first():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_used_blocks == 0 and len(bm.free_cached) == 2   # blocks 0, 1 hold [1,2], [3,4]
    again = seq([1, 2, 3, 4, 7], "again")
    assert admit(bm, again) == blocks[:2] and bm.num_used_blocks == 3
    bm.free(again)
    # plain free blocks go first; then the least recently freed cached block: the chain's tail
    other = seq([8, 8, 8, 8, 8, 8], "other")
    bm.allocate(other, [], 6)   # blocks 2, 3 (plain), then block 1 ([3, 4], freed before block 0)
    assert sorted(other.block_table) == [1, 2, 3]
    assert bm.cached_prefix(seq([1, 2, 3, 4, 0])) == blocks[:1]
    bm.free(other)
    assert bm.reset_prefix_cache() == 1   # block 0, still cached
    assert bm.cached == {} and bm.num_free_blocks == 4 and bm.cached_prefix(seq([1, 2, 3, 4, 0])) == []


def test_can_allocate_counts_revived_cached_blocks():
    bm = BlockManager(3, 2)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    b = seq([1, 2, 3, 4, 6, 7], "b")
    hits = bm.cached_prefix(b)
    assert len(hits) == 2
    # the two cached blocks come out of the free pool too: 2 revived + 1 fresh = 3 <= 3
    assert bm.can_allocate(hits, 6) and not bm.can_allocate(hits, 8)


def test_no_prefix_caching_registers_nothing():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    assert bm.cached == {} and bm.cached_prefix(seq([1, 2, 3, 4, 5])) == [] and bm.query_tokens == 0


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockManager(0, 16)
