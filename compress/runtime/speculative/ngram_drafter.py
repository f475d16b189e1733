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


class NgramDrafter:
    """``propose`` for each sequence up to its ``k`` tokens by prompt lookup. Holds no
    state between steps."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1, window: int = 4096):
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got min {min_n}, max {max_n}")
        self.max_n, self.min_n, self.window = max_n, min_n, window

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        tokens = []
        for seq, k in zip(seqs, ks):
            recent = seq.token_ids[-self.window:] if self.window else seq.token_ids
            tokens.append(lookup(recent, k, self.max_n, self.min_n) if k > 0 else [])
        return Proposal(tokens, None)

    def after_step(self, seq: Sequence) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass

    def stats(self) -> dict:
        return {}
