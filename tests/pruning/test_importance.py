"""pruning/importance.py and depth.py: the aggregations, and the one-pass block-by-block
measurement equal to what hooks on the whole transformers model see."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from compress.architectures import get_arch
from compress.model_source import ModelSource
from compress.stage_executor import build_skeleton
from pruning.depth import BlockImportance
from pruning.importance import ChannelScore, head_norms, measure_importance
from tiny_models import make_tiny_model


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Many tiny ops (see tests/conftest.py::one_thread)."""


X = torch.tensor([[[1., -2.], [3., 0.]],
                  [[0., 4.], [-1., 2.]]])          # [batch 2, seq 2, channels 2]


@pytest.mark.parametrize("sequence, samples, want", [
    ("mean", "l2", [(2.0 ** 2 + 0.5 ** 2) ** 0.5, (1.0 ** 2 + 3.0 ** 2) ** 0.5]),
    ("mean", "mean", [(2.0 + 0.5) / 2, (1.0 + 3.0) / 2]),
    ("max", "max", [3.0, 4.0]),
    ("l2", "l2", [(10.0 + 1.0) ** 0.5, (4.0 + 20.0) ** 0.5]),
])
def test_channel_score_aggregations(sequence, samples, want):
    whole, split = ChannelScore(sequence, samples), ChannelScore(sequence, samples)
    whole.update(X)
    split.update(X[:1])
    split.update(X[1:])                      # batch by batch: the same
    torch.testing.assert_close(whole.value(), torch.tensor(want))
    torch.testing.assert_close(split.value(), torch.tensor(want))


def test_head_norms_are_per_head_l2_over_head_dim():
    x = torch.tensor([[[3., 4., 0., 1.]]])      # two heads of head_dim 2
    assert head_norms(x, 2).tolist() == [[[5.0, 1.0]]]


def test_block_importance_is_zero_for_an_identity_and_one_for_orthogonal_outputs():
    x = torch.randn(2, 5, 8)
    same, orth = BlockImportance(), BlockImportance()
    same.update(x, x)
    orth.update(torch.tensor([[[1., 0.]]]), torch.tensor([[[0., 3.]]]))
    assert abs(same.value()) < 1e-6 and abs(orth.value() - 1.0) < 1e-6


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_one_pass_equals_hooks_on_the_whole_model(family, tmp_path):
    """The block-by-block pass from files gives the statistics that hooks on the whole
    transformers model compute from one forward of the same calibration batches."""
    model_dir = make_tiny_model(tmp_path / "m", family, num_hidden_layers=3)
    ids = torch.randint(2, 512, (5, 16), generator=torch.Generator().manual_seed(0))
    arch = get_arch(family)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    skeleton = build_skeleton(model.config, arch)
    found = measure_importance(skeleton, arch, ModelSource(model_dir), ids,
                               {"mlp", "heads", "hidden", "block_importance"}, batch_size=2)

    want = {k: [ChannelScore() for _ in range(3)] for k in ("mlp", "heads", "hidden")}
    final = ChannelScore()
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(lambda m, a, i=i: want["mlp"][i].update(a[0])))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(
            lambda m, a, i=i: want["heads"][i].update(head_norms(a[0], 32))))
    hidden_rows = [[ChannelScore(), ChannelScore()] for _ in range(3)]
    for i, layer in enumerate(model.model.layers):
        for j, norm in enumerate((layer.input_layernorm, layer.post_attention_layernorm)):
            hooks.append(norm.register_forward_hook(lambda m, a, out, i=i, j=j: hidden_rows[i][j].update(out)))
    hooks.append(model.model.norm.register_forward_hook(lambda m, a, out: final.update(out)))
    states = []
    with torch.no_grad():
        for batch in ids.split(2):
            states.append(model(batch, output_hidden_states=True).hidden_states)
    for h in hooks:
        h.remove()

    torch.testing.assert_close(found.mlp, torch.stack([s.value() for s in want["mlp"]]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(found.heads, torch.stack([s.value() for s in want["heads"]]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(found.hidden(), sum(a.value() + b.value() for a, b in hidden_rows) + final.value(),
                               rtol=1e-5, atol=1e-6)
    for block in range(2):                  # hidden_states[3] is after the final norm: blocks 0 and 1 only
        meter = BlockImportance()
        for s in states:
            meter.update(s[block], s[block + 1])
        assert abs(found.block_importance[block] - meter.value()) < 1e-5
    assert found.mlp.shape == (3, 256) and found.heads.shape == (3, 4) and found.hidden_final.shape == (128,)


def test_lm_loss_increase_is_the_loss_of_the_model_without_that_block(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "llama", num_hidden_layers=3)
    ids = torch.randint(2, 512, (4, 16), generator=torch.Generator().manual_seed(0))
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    arch = get_arch("llama")
    found = measure_importance(build_skeleton(model.config, arch), arch, ModelSource(model_dir), ids,
                               {"lm_loss"}, batch_size=3)

    def loss(m):
        with torch.no_grad():
            return float(m(ids, labels=ids, use_cache=False).loss)

    full = loss(model)
    assert abs(found.lm_loss - full) < 1e-4
    layers = model.model.layers
    for d in range(3):
        model.model.layers = torch.nn.ModuleList([b for i, b in enumerate(layers) if i != d])
        assert abs(found.lm_loss_increase[d] - (loss(model) - full)) < 1e-4, d
    assert found.mlp is None and found.block_importance is None
