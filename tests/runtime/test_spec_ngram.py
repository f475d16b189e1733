"""Prompt lookup (``compress/runtime/speculative/ngram_drafter.py``): what it proposes,
and that the per-request index proposes what the plain scan does as a sequence grows."""
import random

from compress.runtime.speculative.ngram_drafter import NgramIndex, lookup


def test_lookup_takes_the_latest_earlier_occurrence_of_the_longest_tail():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    assert lookup(tokens, 2, max_n=3) == [7, 5]        # "2 3" last seen before the tail at 5-6
    assert lookup([1, 2, 3, 4, 9, 9, 3, 4], 3, max_n=2) == [9, 9, 3]
    assert lookup([5, 6, 7], 3, max_n=3) == []          # no earlier occurrence
    assert lookup([4, 4], 2, max_n=2) == [4]            # only what follows exists
    assert lookup([1, 2, 1], 0, max_n=2) == []


def test_the_index_proposes_what_the_scan_proposes_at_every_length():
    rng = random.Random(0)
    for trial in range(20):
        max_n, min_n = rng.randint(1, 4), 1
        index = NgramIndex(max_n, min_n)
        tokens = [rng.randrange(6) for _ in range(rng.randint(1, 5))]
        for _ in range(60):
            k = rng.randint(0, 5)
            assert index.propose(tokens, k) == lookup(tokens, k, max_n, min_n), (trial, tokens, k)
            tokens += [rng.randrange(6) for _ in range(rng.randint(1, 3))]   # a step appends 1 + accepted
