"""distill/losses.py: KL of equal logits is 0, known values, temperature, top-k, CE, mix."""
import math

import pytest
import torch
import torch.nn.functional as F

from distill.losses import forward_kl, hidden_cosine, mixed_loss, next_token_ce, reverse_kl


def logits(seed, shape=(2, 5, 11)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("loss", [forward_kl, reverse_kl])
def test_kl_of_equal_logits_is_zero_and_positive_otherwise(loss):
    a, b = logits(0), logits(1)
    assert float(loss(a, a)) == pytest.approx(0.0, abs=1e-6)
    assert float(loss(a, a + 5.0)) == pytest.approx(0.0, abs=1e-5)   # a shift of every logit
    assert float(loss(a, b)) > 0.1


def test_known_values_on_two_tokens():
    p, q = torch.tensor([0.8, 0.2]), torch.tensor([0.5, 0.5])
    teacher, student = p.log().view(1, 1, 2), q.log().view(1, 1, 2)
    want_forward = 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5)
    want_reverse = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    assert float(forward_kl(student, teacher)) == pytest.approx(want_forward, rel=1e-5)
    assert float(reverse_kl(student, teacher)) == pytest.approx(want_reverse, rel=1e-5)


def test_temperature_softens_both_and_scales_by_t_squared():
    s, t = logits(2), logits(3)
    T = 2.5
    ps, pt = F.log_softmax(s / T, -1), F.log_softmax(t / T, -1)
    want = (pt.exp() * (pt - ps)).sum(-1).mean() * T * T
    torch.testing.assert_close(forward_kl(s, t, temperature=T), want)
    assert float(forward_kl(s, t, temperature=T)) != pytest.approx(float(forward_kl(s, t)), rel=1e-3)


def test_top_k_keeps_the_teachers_top_tokens_renormalized():
    s, t = logits(4), logits(5)
    k = 3
    values, idx = t.topk(k, -1)
    pt = F.log_softmax(values, -1)
    ps = F.log_softmax(s, -1).gather(-1, idx)
    torch.testing.assert_close(forward_kl(s, t, top_k=k), (pt.exp() * (pt - ps)).sum(-1).mean())
    # k = vocabulary: the full KL
    torch.testing.assert_close(forward_kl(s, t, top_k=11), forward_kl(s, t))
    # a student equal to the teacher on its top-k tokens and -inf-free elsewhere: reverse top-k KL is 0
    assert float(reverse_kl(t, t, top_k=k)) == pytest.approx(0.0, abs=1e-6)


def test_next_token_ce_predicts_the_following_token():
    ids = torch.tensor([[1, 2, 3, 4]])
    sure = torch.full((1, 4, 6), -30.0)
    for pos in range(3):
        sure[0, pos, ids[0, pos + 1]] = 30.0
    assert float(next_token_ce(sure, ids)) < 1e-6
    assert float(next_token_ce(torch.zeros(1, 4, 6), ids)) == pytest.approx(math.log(6), rel=1e-6)


def test_hidden_cosine_through_projection():
    h = torch.randn(2, 3, 4)
    ident = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        ident.weight.copy_(torch.eye(4))
    with torch.no_grad():
        assert float(hidden_cosine([h], [h * 3], [ident])) == pytest.approx(0.0, abs=1e-6)
        assert float(hidden_cosine([h], [-h], [ident])) == pytest.approx(2.0, abs=1e-6)


def test_mix_is_the_weighted_sum_of_its_parts():
    s, t = logits(6), logits(7)
    ids = torch.randint(0, 11, (2, 5))
    total, parts = mixed_loss({"forward_kl": 0.5, "reverse_kl": 0.25, "ce": 2.0}, s, t, ids, temperature=1.5)
    assert set(parts) == {"forward_kl", "reverse_kl", "ce"}
    torch.testing.assert_close(total, 0.5 * forward_kl(s, t, 1.5) + 0.25 * reverse_kl(s, t, 1.5)
                               + 2.0 * next_token_ce(s, ids))
    with pytest.raises(ValueError, match="every loss weight is zero"):
        mixed_loss({"forward_kl": 0.0}, s, t, ids)
