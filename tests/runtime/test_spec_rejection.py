"""The rejection sampler (``compress/runtime/speculative/rejection.py``): greedy and
sampled verdicts in the cases that matter, and, by chi-square, that what it emits follows
the target's distribution whatever the draft's, keeping draft tokens at the rate
sum_x min(p, q)."""
from __future__ import annotations

import math

import pytest
import torch

from compress.runtime.speculative.rejection import (acceptance_probability, target_probs, verify_greedy,
                                                    verify_sampled)


def one_hot_logits(tokens: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    for i, t in enumerate(tokens):
        logits[i, t] = 5.0
    return logits


def test_greedy_keeps_the_whole_run_and_adds_the_bonus():
    v = verify_greedy([3, 1, 4], one_hot_logits([3, 1, 4, 5]))
    assert v.tokens == [3, 1, 4, 5] and v.num_accepted == 3


def test_greedy_stops_at_the_first_mismatch_with_the_targets_token():
    v = verify_greedy([3, 2, 4], one_hot_logits([3, 1, 4, 5]))
    assert v.tokens == [3, 1] and v.num_accepted == 1
    v = verify_greedy([0, 1, 4], one_hot_logits([3, 1, 4, 5]))
    assert v.tokens == [3] and v.num_accepted == 0


def test_no_draft_tokens_is_a_plain_step():
    assert verify_greedy([], one_hot_logits([2])).tokens == [2]
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    v = verify_sampled([], None, p, torch.Generator().manual_seed(0))
    assert v.tokens == [2] and v.num_accepted == 0


def test_sampled_keeps_what_the_target_would_surely_draw_and_rejects_what_it_never_would():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    v = verify_sampled([1, 2], None, p, g)                       # p(d) = 1: always kept, then the bonus
    assert v.tokens == [1, 2, 0] and v.num_accepted == 2
    v = verify_sampled([1, 0], None, p, g)                       # p(d_2) = 0: rejected, resampled from p
    assert v.tokens == [1, 2] and v.num_accepted == 1
    q = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.2, 0.6]])
    v = verify_sampled([1, 1], q, p, g)                          # p(d_2) = 0 < q(d_2)
    assert v.tokens == [1, 2] and v.num_accepted == 1


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="target distributions"):
        verify_sampled([1, 2], None, torch.full((2, 3), 1 / 3))
    with pytest.raises(ValueError, match="draft distributions"):
        verify_sampled([1, 2], torch.full((1, 3), 1 / 3), torch.full((3, 3), 1 / 3))


def test_target_probs_apply_temperature_and_filters_as_the_sampler_does():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    torch.testing.assert_close(target_probs(logits, 0.5, 0, 1.0), (logits / 0.5).softmax(-1))
    top2 = target_probs(logits, 1.0, 2, 1.0)
    assert top2[0, 2:].sum() == 0 and math.isclose(float(top2.sum()), 1.0, rel_tol=1e-6)
    nucleus = target_probs(logits, 1.0, 0, 0.5)       # the top token alone holds 0.64 > 0.5
    assert nucleus[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom over the cells with p > 0."""
    n = counts.sum()
    keep = probs > 0
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


# chi-square quantile at 1 - 1e-4 for the degrees of freedom used below (5 and 35)
CHI2_LIMIT = {5: 25.74, 35: 77.4}


@pytest.mark.parametrize("deterministic", [False, True])
def test_emitted_tokens_follow_the_target_and_alpha_is_sum_of_min(deterministic):
    """k = 2 draft tokens from a draft distribution q far from the target's p (sampled
    from q, or deterministic proposals): the first emitted token follows p_1, the pair
    of the first two follows p_1 x p_2 (given the first token was the draft's), and the
    first draft token is kept at rate sum min(p_1, q_1)."""
    gen = torch.Generator().manual_seed(1234)
    vocab, trials = 6, 12000
    p = torch.tensor([[0.30, 0.05, 0.25, 0.10, 0.20, 0.10],
                      [0.10, 0.40, 0.05, 0.05, 0.30, 0.10],
                      [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])
    q = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.10, 0.10],
                      [0.30, 0.10, 0.30, 0.10, 0.10, 0.10]])
    first = torch.zeros(vocab)
    pairs = torch.zeros(vocab, vocab)      # (first, second) when the first was the kept draft token
    kept_first = 0
    for _ in range(trials):
        if deterministic:
            draft = [int(torch.multinomial(q[0], 1, generator=gen)), int(torch.multinomial(q[1], 1, generator=gen))]
            # a deterministic proposal is one-hot: keep it with probability p(d)
            v = verify_sampled(draft, None, p, gen)
        else:
            draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
            v = verify_sampled(draft, q, p, gen)
        first[v.tokens[0]] += 1
        if v.num_accepted >= 1:
            kept_first += 1
            pairs[v.tokens[0], v.tokens[1]] += 1
    stat, dof = chi_square(first, p[0])
    assert stat < CHI2_LIMIT[dof], f"first token: chi2 {stat:.1f} on {dof} dof"
    # given d_1 was kept, the second token follows p_2 whatever d_1 was
    second = pairs.sum(0)
    stat, dof = chi_square(second, p[1])
    assert stat < CHI2_LIMIT[dof], f"second token: chi2 {stat:.1f} on {dof} dof"
    # alpha of the first position: sum min(p, q) (q one-hot at the drawn token for
    # deterministic proposals: E[p(d)] = sum q p)
    alpha = float((p[0] * q[0]).sum()) if deterministic else float(acceptance_probability(p[0], q[0]))
    sd = math.sqrt(alpha * (1 - alpha) / trials)
    assert abs(kept_first / trials - alpha) < 4 * sd, (kept_first / trials, alpha)


def test_seeded_verdicts_repeat():
    p = torch.full((4, 5), 0.2)
    q = torch.tensor([[0.6, 0.1, 0.1, 0.1, 0.1]] * 3)
    runs = [[verify_sampled([0, 0, 0], q, p, g).tokens for _ in range(20)]
            for g in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))]
    assert runs[0] == runs[1]
