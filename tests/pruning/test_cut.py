"""pruning/cut.py: renumbered blocks, shapes planned without data equal to those streamed,
per-layer config lists following the kept blocks, shape checks naming the tensor."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from compress.architectures import get_arch
from compress.model_source import ModelSource
from pruning.cut import KeptIndices, check_shapes, depth_config, new_name, plan_cut, planned_shapes, stream_cut
from tiny_models import make_tiny_model, tiny_config


class RecordingWriter:
    def __init__(self):
        self.tensors = {}

    def add_dense(self, name, t):
        assert name not in self.tensors
        self.tensors[name] = t


def test_block_tensors_are_renumbered_and_dropped_blocks_skipped():
    arch = get_arch("llama")
    renamed = {0: 0, 2: 1}
    assert new_name(arch, "model.layers.2.mlp.up_proj.weight", renamed) == "model.layers.1.mlp.up_proj.weight"
    assert new_name(arch, "model.layers.1.mlp.up_proj.weight", renamed) is None
    assert new_name(arch, "model.layers.12.mlp.up_proj.weight", {12: 0}) == "model.layers.0.mlp.up_proj.weight"
    assert new_name(arch, "model.norm.weight", renamed) == "model.norm.weight"


def test_layer_types_follow_the_kept_blocks():
    config = tiny_config("qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    smaller, changes = depth_config(config, torch.tensor([1, 3]))
    assert smaller.num_hidden_layers == 2 and smaller.layer_types == ["full_attention", "sliding_attention"]
    assert changes["num_hidden_layers"] == 2
    # max_window_layers (Qwen2's older field) says the same for readers that know only it
    assert smaller.max_window_layers == 1
    assert depth_config(config, torch.tensor([2, 3]))[0].max_window_layers == 0


@pytest.mark.parametrize("tied", [False, True])
def test_streamed_cut_has_the_planned_shapes(tied, tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "qwen2", num_hidden_layers=3, tie_word_embeddings=tied)
    source, arch = ModelSource(model_dir), get_arch("qwen2")
    config = tiny_config("qwen2", num_hidden_layers=3, tie_word_embeddings=tied)
    kept = KeptIndices(blocks=torch.tensor([0, 2]), mlp=torch.arange(0, 256, 4),
                       heads=torch.tensor([[0, 1], [2, 3]]), hidden=torch.arange(0, 128, 2))
    plan = plan_cut(arch, config, kept)
    shapes = {n: list(source.store.entry(n).shape) for n in source.names()}
    writer = RecordingWriter()
    written = stream_cut(source, arch, plan, writer)
    assert written == planned_shapes(arch, shapes, plan)
    assert ("lm_head.weight" in written) == (not tied)
    assert not any(n.startswith("model.layers.2.") for n in written)
    # block 1 of the cut is block 2 of the source, kv head 1 (rows 32..63) of its k bias
    src_bias = source.weight("model.layers.2.self_attn.k_proj.bias")
    assert torch.equal(writer.tensors["model.layers.1.self_attn.k_proj.bias"], src_bias[32:64])
    assert (plan.config.num_hidden_layers, plan.config.intermediate_size, plan.config.hidden_size) == (2, 64, 64)
    assert (plan.config.num_attention_heads, plan.config.num_key_value_heads, plan.config.head_dim) == (2, 1, 32)


def test_a_shape_the_config_does_not_build_is_named():
    config = tiny_config("llama")
    written = {n: list(p.shape) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    check_shapes(config, written)
    written["model.layers.1.mlp.up_proj.weight"] = [128, 128]
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj.weight' was cut to \[128, 128\].*\[256, 128\]"):
        check_shapes(config, written)
    written["model.layers.1.mlp.up_proj.weight"] = [256, 128]
    del written["model.norm.weight"]
    with pytest.raises(ValueError, match="builds 'model.norm.weight', which the cut did not write"):
        check_shapes(config, written)
