"""Synthetic prompts for the decode benchmarks and labs: token ids spread over the
vocabulary, a different sequence per prompt index (so a batch's prompts share no prefix
block and a later round's prompts hit no earlier round's cache, while the indices stay
under the vocabulary's size less 10)."""
from __future__ import annotations


def synthetic_prompts(vocab_size: int, count: int, length: int, first: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids in [5, vocab_size - 5), prompt ``first + r``
    for r < count: token j is (7 j + 13 (first + r)) mod (vocab_size - 10) + 5."""
    span = vocab_size - 10
    return [[(7 * j + 13 * (first + r)) % span + 5 for j in range(length)] for r in range(count)]
