from __future__ import annotations

import pytest
import torch

from compress.runtime import SamplingParams
from compress.runtime.sampling import filter_logits, sample

PROMPT = "The quick brown fox"


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate(PROMPT, p)[0].token_ids
    assert a == llm.generate(PROMPT, p)[0].token_ids
    # a seeded request does not depend on its batch neighbours
    batch = llm.generate([PROMPT, "Hello"], [p, SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)])
    assert batch[0].token_ids == a
    others = {tuple(llm.generate(PROMPT, SamplingParams(max_tokens=10, seed=s, ignore_eos=True))[0].token_ids)
              for s in range(4)}
    assert len(others) > 1


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    top1 = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids


def test_top_p_and_top_k_restrict_the_support():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    logits = probs.log()
    kept = filter_logits(logits, torch.tensor([0, 2]), torch.tensor([0.7, 1.0])).isfinite()
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False]]
    gens = [torch.Generator().manual_seed(0), None]
    seen = set()
    for _ in range(200):
        tok = sample(logits, torch.tensor([1.0, 1.0]), torch.tensor([0, 2]), torch.tensor([0.7, 1.0]), gens)
        seen.add((int(tok[0]), int(tok[1])))
    assert {a for a, _ in seen} == {0, 1} and {b for _, b in seen} == {0, 1}


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).repeat(20000, 1)
    n = logits.shape[0]
    toks = sample(logits, torch.ones(n), torch.zeros(n, dtype=torch.long), torch.ones(n), [None] * n)
    freq = torch.bincount(toks, minlength=3).float() / n
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.02, rtol=0)


def test_greedy_rows_mixed_with_sampled_rows():
    logits = torch.randn(3, 50)
    toks = sample(logits, torch.tensor([0.0, 1.0, 0.0]), torch.zeros(3, dtype=torch.long), torch.ones(3),
                  [None] * 3)
    assert toks[0] == logits[0].argmax() and toks[2] == logits[2].argmax()


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                                    dict(top_k=-2)])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**kwargs)


def test_stop_normalised():
    assert SamplingParams(stop="##").stop == ["##"]
