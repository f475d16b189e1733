"""pruning/channel_slices.py: the slices of a channel cut give a model transformers loads,
and removing channels that contribute nothing leaves the model's output unchanged."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from compress.architectures import get_arch
from pruning.channel_slices import apply_slices, plan_channel_cut, smaller_config
from tiny_models import FAMILIES, tiny_config

# sizes that differ from each other, so a shape tells which index space it is
SHAPE = dict(hidden_size=96, head_dim=32, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Many tiny ops (see tests/conftest.py::one_thread)."""


def tiny_model(family: str, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family, **{**SHAPE, **overrides})).eval()


def checkpoint(model) -> dict[str, torch.Tensor]:
    """The tensors as a checkpoint stores them: a tied head once, as the embedding."""
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    return tensors


def cut_and_load(model, group: str, kept, out: Path):
    """Slice ``model``'s tensors, write them with the smaller config, load with transformers."""
    from transformers import AutoModelForCausalLM

    arch = get_arch(model.config.model_type)
    cut = plan_channel_cut(arch, model.config, group, kept)
    out.mkdir()
    smaller_config(model.config, cut.config).save_pretrained(out)
    save_file(apply_slices(checkpoint(model), cut.slices), str(out / "model.safetensors"))
    small, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return small.eval(), cut


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_removing_silent_mlp_channels_changes_nothing(family, tmp_path):
    model = tiny_model(family)
    kept = torch.stack([torch.arange(0, 160, 2), torch.arange(80, 160)])     # a different choice per block
    for block, row in enumerate(kept):
        removed = torch.ones(160, dtype=torch.bool)
        removed[row] = False
        with torch.no_grad():
            model.model.layers[block].mlp.down_proj.weight[:, removed] = 0
    small, cut = cut_and_load(model, "mlp", kept, tmp_path / "small")
    assert cut.config == {"intermediate_size": 80}
    assert small.model.layers[1].mlp.gate_proj.weight.shape == (80, 96)
    assert small.model.layers[1].mlp.down_proj.weight.shape == (96, 80)
    torch.testing.assert_close(logits(small, IDS), logits(model, IDS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_removing_live_mlp_channels_changes_the_output(family, tmp_path):
    """The control of the test above: the same cut on channels that contribute."""
    model = tiny_model(family)
    small, _ = cut_and_load(model, "mlp", torch.arange(0, 160, 2), tmp_path / "small")
    assert (logits(small, IDS) - logits(model, IDS)).abs().max() > 1e-3


def silence_query_heads(model, kept_per_block, heads=4, head_dim=32):
    for block, kept in enumerate(kept_per_block):
        o = model.model.layers[block].self_attn.o_proj.weight
        with torch.no_grad():
            for h in set(range(heads)) - set(kept):
                o[:, h * head_dim:(h + 1) * head_dim] = 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kept, kv_heads", [
    ([[0, 3], [1, 2]], 2),      # one query head of each kv head: k/v stay whole
    ([[2, 3], [0, 1]], 1),      # a whole kv group goes: its k/v rows with it
])
def test_removing_silent_heads_changes_nothing(family, kept, kv_heads, tmp_path):
    model = tiny_model(family)
    silence_query_heads(model, kept)
    small, cut = cut_and_load(model, "attention_heads", torch.tensor(kept), tmp_path / "small")
    assert cut.config == {"num_attention_heads": 2, "num_key_value_heads": kv_heads, "head_dim": 32}
    attn = small.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (64, 96) and attn.o_proj.weight.shape == (96, 64)
    assert attn.k_proj.weight.shape == (kv_heads * 32, 96) and attn.v_proj.weight.shape == (kv_heads * 32, 96)
    assert (attn.k_proj.bias is not None) == (family == "qwen2")
    torch.testing.assert_close(logits(small, IDS), logits(model, IDS), rtol=0, atol=1e-5)


def test_kv_rows_follow_the_kept_group(tmp_path):
    """Block 0 keeps kv head 1 only: its k rows are the original's second head."""
    model = tiny_model("qwen2")
    small, _ = cut_and_load(model, "attention_heads", torch.tensor([[2, 3], [0, 1]]), tmp_path / "small")
    big, cut_k = model.model.layers[0].self_attn.k_proj, small.model.layers[0].self_attn.k_proj
    assert torch.equal(cut_k.weight, big.weight[32:64]) and torch.equal(cut_k.bias, big.bias[32:64])
    assert torch.equal(small.model.layers[1].self_attn.v_proj.weight, model.model.layers[1].self_attn.v_proj.weight[:32])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_hidden_cut_gives_a_loadable_smaller_model(family, tied, tmp_path):
    """RMSNorm mixes the hidden channels (mean square), so no exactness here: every
    tensor's shape, a transformers load, and the kept values where they were."""
    model = tiny_model(family, tie_word_embeddings=tied)
    kept = torch.arange(0, 96, 3)
    small, cut = cut_and_load(model, "hidden", kept, tmp_path / "small")
    assert cut.config == {"hidden_size": 32, "head_dim": 32}
    names = [s.name for s in cut.slices]
    assert ("lm_head.weight" in names) == (not tied) and "model.embed_tokens.weight" in names
    assert len(names) == len(set(names))
    for name, t in small.state_dict().items():
        assert 96 not in t.shape, name                          # no hidden-sized dim left anywhere
    layer = small.model.layers[1]
    assert layer.self_attn.q_proj.weight.shape == (128, 32) and layer.self_attn.o_proj.weight.shape == (32, 128)
    assert layer.mlp.down_proj.weight.shape == (32, 160)
    torch.testing.assert_close(small.model.embed_tokens.weight, model.model.embed_tokens.weight[:, kept])
    torch.testing.assert_close(layer.input_layernorm.weight, model.model.layers[1].input_layernorm.weight[kept])
    torch.testing.assert_close(layer.mlp.down_proj.weight, model.model.layers[1].mlp.down_proj.weight[kept])
    if tied:
        assert small.lm_head.weight.data_ptr() == small.model.embed_tokens.weight.data_ptr()
    out = logits(small, IDS)
    assert out.shape == (2, 12, 512) and torch.isfinite(out).all()


def test_cuts_compose(tmp_path):
    """MLP, then heads, then hidden: each cut planned on the config the last one made."""
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    arch, config, tensors = get_arch("llama"), model.config, checkpoint(model)
    for group, kept in (("mlp", torch.arange(64)), ("attention_heads", torch.tensor([0, 2])),
                        ("hidden", torch.arange(48))):
        cut = plan_channel_cut(arch, config, group, kept)
        tensors, config = apply_slices(tensors, cut.slices), smaller_config(config, cut.config)
    config.save_pretrained(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    small = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (small.config.hidden_size, small.config.intermediate_size) == (48, 64)
    assert (small.config.num_attention_heads, small.config.num_key_value_heads) == (2, 2)
    assert logits(small, IDS).shape == (2, 12, 512)


@pytest.mark.parametrize("group, kept, message", [
    ("mlp", [3, 1], "strictly increasing"),
    ("mlp", [0, 160], r"\[0, 160\)"),
    ("mlp", [], "keeps nothing"),
    ("mlp", [0.0, 1.0], "integers"),
    ("mlp", [[0, 1], [0, 1], [0, 1]], r"one row per block \[2, k\]"),
    ("hidden", [[0, 1], [0, 1]], r"one row \[k\]"),
    ("attention_heads", [0, 1, 2], r"block 0 keeps query heads \[0, 1, 2\].*same number of query heads"),
    ("attention_heads", [[0, 1], [0, 2]], "different numbers of kv heads"),
    ("experts", [0], "no channel group 'experts'"),
])
def test_bad_kept_indices_are_named(group, kept, message):
    model = tiny_model("llama")
    with pytest.raises((ValueError, KeyError), match=message):
        plan_channel_cut(get_arch("llama"), model.config, group, kept)


@pytest.mark.parametrize("flag, group, refused", [
    ("attention_bias", "mlp", False), ("mlp_bias", "mlp", True),
    ("attention_bias", "hidden", True), ("mlp_bias", "hidden", True),
])
def test_biases_the_table_does_not_list_are_refused_where_the_cut_reaches_them(flag, group, refused):
    """llama's attention_bias / mlp_bias tensors are not in the channel table: a cut that
    would slice them is refused; one that does not reach them (an MLP cut beside attention
    biases) goes on."""
    config = tiny_config("llama", **SHAPE, **{flag: True})
    if refused:
        with pytest.raises(ValueError, match=flag):
            plan_channel_cut(get_arch("llama"), config, group, [0, 1])
    else:
        cut = plan_channel_cut(get_arch("llama"), config, group, [[0, 1]] * config.num_hidden_layers)
        assert cut.config == {"intermediate_size": 2}


def test_apply_slices_names_the_tensor():
    cut = plan_channel_cut(get_arch("llama"), tiny_config("llama", **SHAPE), "mlp", [0, 1])
    with pytest.raises(KeyError, match="model.layers.0.mlp.gate_proj.weight"):
        apply_slices({}, cut.slices)
    with pytest.raises(ValueError, match="model.layers.0.mlp.gate_proj.weight"):
        apply_slices({s.name: torch.zeros(1, 1) for s in cut.slices}, cut.slices)
