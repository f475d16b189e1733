import pytest
import torch

from compress.architectures import ARCHITECTURES, ScaleGroup, UnsupportedArchitectureError, get_arch
from tiny_models import tiny_config


def test_unsupported_architecture_lists_supported():
    with pytest.raises(UnsupportedArchitectureError) as err:
        get_arch("gpt2", where="x/config.json")
    msg = str(err.value)
    assert "'gpt2'" in msg and "x/config.json" in msg
    for name in ("llama", "mistral", "qwen2", "qwen3", "LlamaForCausalLM", "Qwen3ForCausalLM"):
        assert name in msg


def test_tables_name_real_modules(tiny_family_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_family_dir)
    arch = get_arch(model.config.model_type)
    block = model.get_submodule(arch.block_prefix(0))
    for name in arch.block_linears:
        block.get_submodule(name)
    for group in arch.scale_groups:
        block.get_submodule(group.prev)
        assert group.prev_kind in ("norm", "linear")
    model.get_submodule(arch.embed_tokens), model.get_submodule(arch.final_norm), model.get_submodule(arch.lm_head)
    assert (block.self_attn.q_proj.bias is not None) == arch.qkv_bias
    for name in (arch.q_norm, arch.k_norm):   # Qwen3's per-head norms exist exactly where the table says
        assert (name in dict(block.named_modules())) == arch.qk_norm
    assert set(ARCHITECTURES) >= {"llama", "mistral", "qwen2", "qwen3"}


def test_scale_groups_are_the_four_llama_groups():
    """The table's scale groups, now data, are those AWQ has always scaled."""
    for arch in ARCHITECTURES.values():
        assert arch.scale_groups == (
            ScaleGroup(arch.attn_norm, "norm", (arch.q_proj, arch.k_proj, arch.v_proj)),
            ScaleGroup(arch.v_proj, "linear", (arch.o_proj,)),
            ScaleGroup(arch.mlp_norm, "norm", (arch.gate_proj, arch.up_proj)),
            ScaleGroup(arch.up_proj, "linear", (arch.down_proj,)),
        )


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_channel_groups_cover_every_dimension_of_their_size(family, tied):
    """Every member names a real tensor whose axis has the group's size, and every tensor
    dimension of that size is some member's (sizes chosen distinct so a size says which
    index space a dimension is): a forgotten norm or bias would show here."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, hidden_size=96, head_dim=32, intermediate_size=160, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    arch = get_arch(family)
    params = dict(model.named_parameters())          # a tied head appears once, as the embedding
    unit_size = {"channel": None, "query_head": 4 * 32, "kv_head": 2 * 32}
    kind_size = {"mlp_channel": 160, "query_head": 4 * 32, "hidden_channel": 96}
    for group in arch.channel_groups:
        covered = set()
        for m in group.members:
            if m.tied_to is not None and tied:
                assert m.tied_to in params
                continue
            names = [m.tensor] if m.scope == "model" else [f"{arch.block_prefix(i)}.{m.tensor}" for i in range(2)]
            for name in names:
                assert name in params, (group.name, name)
                assert params[name].shape[m.axis] == (unit_size[m.unit] or kind_size[group.kind]), (group.name, name)
                covered.add((name, m.axis))
        size = kind_size[group.kind]
        wanted = {(n, d) for n, p in params.items() for d, s in enumerate(p.shape) if s == size}
        if group.kind == "query_head":   # q rows and o columns; k/v rows are the kv heads'
            wanted |= {(n, 0) for n in params if n.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias",
                                                               "v_proj.bias"))}
        assert covered == wanted, (group.name, sorted(wanted ^ covered))
