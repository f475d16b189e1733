"""pruning/selection.py: top-k and random choices, GQA-shaped head choices."""
import pytest
import torch

from compress.architectures import get_arch
from pruning.channel_slices import plan_channel_cut
from pruning.selection import choose_heads, random_k, top_k
from tiny_models import tiny_config


def test_top_k_keeps_the_highest_in_ascending_order_ties_to_the_lower_index():
    scores = torch.tensor([[0.1, 5.0, 3.0, 5.0, 0.0], [1.0, 1.0, 1.0, 1.0, 2.0]])
    assert top_k(scores, 2).tolist() == [[1, 3], [0, 4]]
    assert top_k(scores[0], 3).tolist() == [1, 2, 3]
    assert top_k(scores, 2).dtype == torch.int64
    with pytest.raises(ValueError, match="cannot keep 6 of 5"):
        top_k(scores, 6)


def test_random_k_is_seeded_and_draws_each_row_apart():
    a = random_k(100, 10, torch.Generator().manual_seed(3), rows=4)
    b = random_k(100, 10, torch.Generator().manual_seed(3), rows=4)
    c = random_k(100, 10, torch.Generator().manual_seed(4), rows=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (4, 10) and (a.diff(dim=1) > 0).all()
    assert len({tuple(r) for r in a.tolist()}) == 4
    assert random_k(5, 5, torch.Generator()).tolist() == [0, 1, 2, 3, 4]


def test_choose_heads_keeps_the_best_groups_then_the_best_heads_in_each():
    # 8 query heads over 4 kv heads (2 each); block 0: groups 1 and 3 sum highest
    scores = torch.tensor([[1., 0., 9., 2., 0., 1., 3., 4.],
                           [5., 6., 0., 0., 1., 0., 0., 0.]])
    kept = choose_heads(scores, 2, heads=8, kv_heads=4, keep_heads=2, keep_kv=2)
    assert kept.tolist() == [[2, 7], [1, 4]]
    whole = choose_heads(scores, 2, heads=8, kv_heads=4, keep_heads=4, keep_kv=2)
    assert whole.tolist() == [[2, 3, 6, 7], [0, 1, 4, 5]]
    same_kv = choose_heads(scores, 2, heads=8, kv_heads=4, keep_heads=4, keep_kv=4)
    assert same_kv.tolist() == [[0, 2, 5, 7], [1, 2, 4, 6]]


@pytest.mark.parametrize("keep_heads, keep_kv", [(2, 2), (2, 1), (4, 2), (6, 3)])
def test_random_head_choices_are_layouts_the_cut_accepts(keep_heads, keep_kv):
    config = tiny_config("llama", num_attention_heads=12, num_key_value_heads=6, hidden_size=96, head_dim=8,
                         num_hidden_layers=3)
    kept = choose_heads(None, 3, 12, 6, keep_heads, keep_kv, torch.Generator().manual_seed(0))
    cut = plan_channel_cut(get_arch("llama"), config, "attention_heads", kept)
    assert cut.config["num_attention_heads"] == keep_heads and cut.config["num_key_value_heads"] == keep_kv


def test_impossible_head_layouts_are_refused():
    with pytest.raises(ValueError, match="cannot keep 3 query heads in 2 kv groups"):
        choose_heads(None, 1, 8, 4, 3, 2, torch.Generator())
    with pytest.raises(ValueError, match="cannot keep 6 query heads in 2 kv groups"):
        choose_heads(None, 1, 8, 4, 6, 2, torch.Generator())
