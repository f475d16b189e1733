from __future__ import annotations

import pytest
import torch

from compress.runtime import SamplingParams
from compress.runtime.sampling import (NUCLEUS_START, BatchSampler, add_logit_bias, apply_penalties, filter_logits,
                                      inverse_cdf, k_limits, logsumexp_rows, nucleus_candidates, sample, token_counts)

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
    # distinct probabilities: tokens tied at a cut may be kept in either order
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.3, 0.28, 0.22, 0.2]])
    logits = probs.log()
    kept = filter_logits(logits, torch.tensor([0, 2]), torch.tensor([0.7, 1.0])).isfinite()
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False]]
    gens = [torch.Generator().manual_seed(0), None]
    seen = set()
    for _ in range(200):
        tok = sample(logits, torch.tensor([1.0, 1.0]), torch.tensor([0, 2]), torch.tensor([0.7, 1.0]), gens)
        seen.add((int(tok[0]), int(tok[1])))
    assert {a for a, _ in seen} == {0, 1} and {b for _, b in seen} == {0, 1}


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])   # flat to peaked
def test_nucleus_candidates_keep_what_filter_logits_keeps(scale):
    """The sampler's top-k / top-p sets, taken from the largest logits without sorting
    the vocabulary, are filter_logits' sets, row by row and for the batch at once; a row
    whose set would pass a quarter of the vocabulary gets None (sample() sorts it)."""
    g = torch.Generator().manual_seed(0)
    settings = [(0, 0.5), (0, 0.9), (0, 0.99), (1, 1.0), (5, 1.0), (50, 0.9), (300, 0.95), (9000, 0.7), (7, 0.3)]
    logits = torch.randn(len(settings), 20000, generator=g) * scale
    top_k = torch.tensor([k for k, _ in settings])
    top_p = torch.tensor([p for _, p in settings])
    want = filter_logits(logits, top_k, top_p).isfinite()

    def check(rows):
        part = logits[rows]
        candidates = nucleus_candidates(part, *k_limits(top_k[rows], part.shape[1]), top_p[rows], logsumexp_rows(part))
        if candidates is None:   # a wide nucleus, or a top_k past a quarter of the vocabulary
            assert int(want[rows].sum(dim=-1).max()) > NUCLEUS_START or int(top_k[rows].max()) > 20000 // 4
            return False
        vals, ids = candidates
        for i, r in enumerate(rows):
            assert set(ids[i][vals[i].isfinite()].tolist()) == set(want[r].nonzero().squeeze(1).tolist()), settings[r]
            finite = vals[i].isfinite()
            assert finite[:int(finite.sum())].all()   # the kept tokens come first, in descending order
            assert bool((vals[i][finite].diff() <= 0).all())
        return True

    taken = [check([r]) for r in range(len(settings))]
    assert taken[3] and taken[4] and taken[8]   # top_k 1 / 5, and a small nucleus, never need the sort
    assert not taken[7]   # top_k 9,000: its normaliser needs all 9,000, past a quarter of 20,000
    if scale > 10:
        rest = [r for r in range(len(settings)) if r != 7]
        assert all(taken[r] for r in rest) and check(rest)


def test_filtered_sampling_follows_the_kept_distribution():
    """top_p 0.8 over p = (0.5, 0.25, 0.15, 0.1): the nucleus is the first three tokens,
    drawn in proportion 0.5 : 0.25 : 0.15; seeded rows draw from their own generators."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 20000
    logits = probs.log().repeat(n, 1)
    gens = [torch.Generator().manual_seed(i) if i % 2 else None for i in range(n)]
    toks = sample(logits, torch.ones(n), torch.zeros(n, dtype=torch.long), torch.full((n,), 0.8), gens)
    freq = torch.bincount(toks, minlength=4).float() / n
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.25, 0.15, 0.0]) / 0.9, atol=0.02, rtol=0)


@pytest.mark.parametrize("scale", [0.3, 6.0])   # the sort path, the candidates path
def test_sample_draws_from_the_kept_set_in_proportion(scale):
    """Over a 20,000-token vocabulary, top_p 0.9 at temperature 0.7: every draw is in
    filter_logits' set and the most likely token comes up in its renormalised share."""
    g = torch.Generator().manual_seed(1)
    row = torch.randn(20000, generator=g) * scale
    n = 1000 if scale > 1 else 250   # the flat row's share is ~0: fewer draws show all are in the set
    logits = row.repeat(n, 1)
    temp, k, p = torch.full((n,), 0.7), torch.zeros(n, dtype=torch.long), torch.full((n,), 0.9)
    kept = filter_logits(row.unsqueeze(0) / 0.7, k[:1], p[:1])[0]
    toks = sample(logits, temp, k, p, [None] * n)
    assert bool(kept[toks].isfinite().all())
    top = int(row.argmax())
    share = float(kept.softmax(dim=-1)[top])
    assert abs(float((toks == top).float().mean()) - share) < 0.03 + 0.05 * share


def test_a_seeded_filtered_row_draws_the_same_whatever_its_batch():
    """bf16-rounded logits tie often. A seeded top_p row draws the same token alone, next
    to a top_k 300 row (more candidates for the batch) and next to a flat row (the batch
    sorts instead): the set comes in one order (value, then token id) and its cut and
    weights in the same bits either way."""
    g = torch.Generator().manual_seed(3)
    V = 32000
    row = (torch.randn(V, generator=g) * 4).bfloat16().float()
    big_k = (torch.randn(V, generator=g) * 4).bfloat16().float()
    flat = (torch.randn(V, generator=g) * 0.1).bfloat16().float()

    def draw(seed, other=None, other_k=0, other_p=1.0):
        rows = [row] if other is None else [row, other]
        n = len(rows)
        gens = [torch.Generator().manual_seed(seed)] + [torch.Generator().manual_seed(99)] * (n - 1)
        k = torch.tensor([0, other_k][:n])
        p = torch.tensor([0.9, other_p][:n])
        return int(sample(torch.stack(rows), torch.full((n,), 0.8), k, p, gens)[0])

    alone = [draw(s) for s in range(40)]
    assert len(set(alone)) > 3
    assert [draw(s, big_k, other_k=300) for s in range(40)] == alone
    assert [draw(s, flat, other_p=0.95) for s in range(40)] == alone


@pytest.mark.parametrize("bad", ["nan", "inf", "tiny_temperature"])
def test_rows_that_cannot_be_sampled_take_their_argmax(bad):
    """A NaN or an infinity in a row, or a temperature under MIN_TEMPERATURE (its logits
    would overflow), make that row greedy; the other rows still sample, nothing raises."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 20000, generator=g) * 3
    temp = torch.tensor([0.8, 0.8, 0.8])
    if bad == "nan":
        logits[0, 5] = float("nan")
    elif bad == "inf":
        logits[0, 7] = float("inf")
    else:
        temp[0] = 1e-39
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    for top_k, top_p in ((0, 0.9), (40, 1.0), (0, 1.0)):
        toks = sample(logits, temp, torch.full((3,), top_k), torch.full((3,), top_p), gens)
        assert int(toks[0]) == int(torch.ops.compress.argmax_rows(logits[:1])[0])
        assert all(0 <= int(t) < 20000 for t in toks)


def test_inverse_cdf_never_draws_a_zero_probability_index():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.3, 0.0, 0.7, 0.0], [0.0, 1.0, 0.0, 0.0]])
    for u in (0.0, 0.29, 0.3, 0.5, 1 - 2 ** -24):
        idx = inverse_cdf(probs, torch.full((3,), u))
        assert all(probs[r, int(i)] > 0 for r, i in enumerate(idx)), (u, idx)
    assert inverse_cdf(probs, torch.tensor([0.49, 0.31, 0.0])).tolist() == [0, 2, 1]


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
                                    dict(top_k=-2), dict(presence_penalty=2.5), dict(frequency_penalty=-2.1),
                                    dict(presence_penalty=float("nan")), dict(repetition_penalty=0),
                                    dict(repetition_penalty=float("inf")), dict(logit_bias={-1: 1.0}),
                                    dict(logit_bias={"5": 1.0}), dict(logit_bias={5: 100.5}),
                                    dict(logit_bias={5: float("nan")})])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**kwargs)


def test_stop_normalised():
    assert SamplingParams(stop="##").stop == ["##"]


def test_penalties_by_hand():
    """Row 0: repetition 2 over prompt {1} and output {2, 2}, frequency 0.5, presence 1;
    row 1: no penalty (its logits unchanged bit for bit)."""
    logits = torch.tensor([[1.0, 4.0, -2.0, 3.0], [1.0, 4.0, -2.0, 3.0]])
    counts, seen = token_counts([([1], [2, 2]), ([1], [2])], [True, False], 4)
    assert counts.tolist() == [[0, 0, 2, 0], [0, 0, 0, 0]]
    assert seen.tolist() == [[False, True, True, False], [False] * 4]
    got = apply_penalties(logits, counts, seen, torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.0]),
                          torch.tensor([2.0, 1.0]))
    assert got[0].tolist() == [1.0, 4.0 / 2, -2.0 * 2 - 0.5 * 2 - 1.0, 3.0]
    assert torch.equal(got[1], logits[1])


def test_a_penalized_row_needs_its_history():
    sampler = BatchSampler([SamplingParams(temperature=0), SamplingParams(temperature=0, presence_penalty=1.0)])
    with pytest.raises(ValueError, match="penalized batch needs each row's"):
        sampler(torch.randn(2, 8))
    assert sampler(torch.randn(2, 8), [([1], []), ([1], [3])]).shape == (2,)


def _greedy_with_penalties(llm, prompt_ids, params, n):
    """Greedy decoding recomputed from cache-free forwards, the penalties applied by hand."""
    ids = list(prompt_ids)
    for _ in range(n):
        logits = llm.logits([ids])[0][-1:].float()
        out = ids[len(prompt_ids):]
        counts = torch.zeros_like(logits)
        for t in out:
            counts[0, t] += 1
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[0, ids] = True
        logits = apply_penalties(logits, counts, seen, torch.tensor([params.presence_penalty]),
                                 torch.tensor([params.frequency_penalty]), torch.tensor([params.repetition_penalty]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=0.3),
                                       dict(frequency_penalty=-2.0),
                                       dict(presence_penalty=-2.0, frequency_penalty=0.5)])
def test_penalized_greedy_matches_recompute_and_ignores_its_batch(llm, penalties):
    """Greedy decoding with penalties gives the tokens of a recompute that applies them by
    hand; batched with an unpenalized sampled request it gives the same tokens as alone,
    and the penalties change what plain greedy decoding gives (the test model's greedy
    text rarely repeats a token, so most cases here ask for repeats)."""
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **penalties)
    alone = llm.generate(PROMPT, p)[0]
    assert alone.token_ids == _greedy_with_penalties(llm, alone.prompt_token_ids, p, 12)
    other = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    assert llm.generate([PROMPT, "Hello there"], [p, other])[0].token_ids == alone.token_ids
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert plain.token_ids != alone.token_ids


def test_logit_bias_by_hand():
    """Row 0: +3 on token 0 and -100 on token 1 (its argmax); row 1: no bias (its logits
    unchanged bit for bit). Zero biases are dropped; a token past the vocabulary is named."""
    logits = torch.tensor([[1.0, 4.0, -2.0, 3.0], [1.0, 4.0, -2.0, 3.0]])
    assert SamplingParams(logit_bias={2: 0.0}).logit_bias is None
    sampler = BatchSampler([SamplingParams(temperature=0, logit_bias={0: 3.0, 1: -100}), SamplingParams(temperature=0)])
    got = add_logit_bias(logits, *sampler.bias)
    assert got[0].tolist() == [4.0, -96.0, -2.0, 3.0] and torch.equal(got[1], logits[1])
    assert sampler(logits).tolist() == [0, 1]
    with pytest.raises(ValueError, match="logit_bias names token 9, outside the vocabulary of 4"):
        BatchSampler([SamplingParams(logit_bias={9: 1.0})])(logits[:1])


def test_biased_greedy_matches_recompute_and_ignores_its_batch(llm):
    """A greedy request that bans each plain greedy token in turn, and favours another:
    the engine (native decode steps, no greedy fast path) gives the recompute's tokens,
    alone and batched with a sampled request."""
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    bias = {plain.token_ids[0]: -100.0, plain.token_ids[1]: -100.0, 7: 5.0}
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logit_bias=bias)
    alone = llm.generate(PROMPT, p)[0]
    ids = list(alone.prompt_token_ids)
    for _ in range(8):
        logits = llm.logits([ids])[0][-1].float().clone()
        for t, b in bias.items():
            logits[t] += b
        ids.append(int(logits.argmax()))
    assert alone.token_ids == ids[len(alone.prompt_token_ids):]
    assert plain.token_ids[0] not in alone.token_ids and alone.token_ids != plain.token_ids
    other = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    assert llm.generate([PROMPT, "Hello there"], [p, other])[0].token_ids == alone.token_ids
