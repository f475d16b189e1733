"""Prompt lookup (n-gram) drafting: no draft model.

The last ``n`` tokens of a sequence (``n`` from ``max_n`` down to ``min_n``) are looked
up earlier in the same sequence (prompt and output); the tokens that followed the most
recent earlier occurrence are the proposal. It pays where outputs repeat their input
(code edits, extraction, quoting, summaries) and costs almost nothing where they do not:
no match proposes nothing and the step is a plain decode. Proposals are deterministic,
so the rejection sampler treats them as one-hot drafts.
"""
from __future__ import annotations

from compress.runtime.sequence import Sequence
from compress.runtime.speculative.proposal import Proposal


def lookup(tokens: list[int], k: int, max_n: int, min_n: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``tokens``'
    last ``n``-gram, trying the longest ``n`` first; ``[]`` when none occurs."""
    total = len(tokens)
    if k < 1:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        tail = tokens[total - n:]
        first = tail[0]
        # latest start i < total - n with tokens[i:i+n] == tail
        i = total - n - 1
        while i >= 0:
            if tokens[i] == first and tokens[i:i + n] == tail:
                follow = tokens[i + n:i + n + k]
                if follow:
                    return follow
            i -= 1
    return []


class NgramIndex:
    """``lookup`` for one growing sequence in O(max_n) a step: for each n, the latest end
    of every n-gram that is followed by a token, updated with the tokens appended since
    the last call (a sequence's tokens only grow, preemption included)."""

    def __init__(self, max_n: int, min_n: int):
        self.max_n, self.min_n = max_n, min_n
        self.ends: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0     # n-grams ending at positions <= indexed are in ``ends``

    def propose(self, tokens: list[int], k: int) -> list[int]:
        total = len(tokens)
        for end in range(self.indexed + 1, total):      # n-grams ending before the last token
            for n, ends in self.ends.items():
                if end >= n:
                    ends[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, total - 1)
        if k < 1:
            return []
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            end = self.ends[n].get(tuple(tokens[total - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []


class NgramDrafter:
    """``propose`` for each sequence up to its ``k`` tokens by prompt lookup; an index per
    request (``NgramIndex``), dropped when the request ends."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got min {min_n}, max {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        tokens = []
        for seq, k in zip(seqs, ks):
            index = self.indexes.get(seq.request_id)
            if index is None:
                index = self.indexes[seq.request_id] = NgramIndex(self.max_n, self.min_n)
            tokens.append(index.propose(seq.token_ids, k))
        return Proposal(tokens, None)

    def after_step(self, seq: Sequence) -> None:
        pass

    def release(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)

    def stats(self) -> dict:
        return {}
