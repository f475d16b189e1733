import pytest

from compress.architectures import ARCHITECTURES, UnsupportedArchitectureError, get_arch


def test_unsupported_architecture_lists_supported():
    with pytest.raises(UnsupportedArchitectureError) as err:
        get_arch("gpt2", where="x/config.json")
    msg = str(err.value)
    assert "'gpt2'" in msg and "x/config.json" in msg
    for name in ("llama", "mistral", "qwen2", "LlamaForCausalLM"):
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
    assert set(ARCHITECTURES) >= {"llama", "mistral", "qwen2"}
