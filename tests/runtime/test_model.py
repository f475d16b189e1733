"""Our decoder's logits against transformers' on the same dense weights."""
from __future__ import annotations

import pytest
import torch

from compress.runtime import LLM
from compress.runtime.models.rope import UnsupportedRopeError

from runtime_models import save_model

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _ids(vocab: int, b: int = 2, t: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"rope_parameters": LLAMA3_ROPE}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}}),
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("qwen3", {"tie_word_embeddings": True}),
])
def test_logits_match_transformers(tmp_path, tokenizer, family, overrides):
    path, ref = save_model(tmp_path, family, tokenizer, **overrides)
    llm = LLM(path)
    ids = _ids(len(tokenizer))
    with torch.no_grad():
        expected = ref(ids).logits
    got = llm.logits(ids)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_bf16_close_to_transformers_bf16(tmp_path, tokenizer):
    path, ref = save_model(tmp_path, "llama", tokenizer)
    ids = _ids(len(tokenizer), t=24)
    with torch.no_grad():
        expected = ref.to(torch.bfloat16)(ids).logits.float()
    got = LLM(path, dtype="bfloat16").logits(ids)
    assert LLM(path, dtype="bfloat16").model.dtype == torch.bfloat16
    err = (got - expected).pow(2).mean() / expected.pow(2).mean()
    assert err < 1e-3, err


def test_padded_rows_equal_unpadded(llm):
    """Left or right padding with an attention mask leaves every real position unchanged."""
    a, b = _ids(llm.model.vocab_size, 1, 20)[0], _ids(llm.model.vocab_size, 1, 12, seed=2)[0]
    alone_a, alone_b = llm.logits(a[None])[0], llm.logits(b[None])[0]
    for left in (True, False):
        ids = torch.zeros(2, 20, dtype=torch.long)
        mask = torch.zeros(2, 20, dtype=torch.long)
        ids[0], mask[0] = a, 1
        sl = slice(8, 20) if left else slice(0, 12)
        ids[1, sl], mask[1, sl] = b, 1
        out = llm.logits(ids, mask)
        torch.testing.assert_close(out[0], alone_a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[1, sl], alone_b, atol=1e-5, rtol=1e-5)


def test_unsupported_rope_type_is_refused(tmp_path, tokenizer):
    path, _ = save_model(tmp_path, "llama", tokenizer,
                         rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(UnsupportedRopeError, match="dynamic"):
        LLM(path)


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["equal_head", "other_head"])
def test_a_tied_checkpoint_that_stores_its_head(tmp_path, tokenizer, offset):
    """tie_word_embeddings with lm_head.weight stored anyway (some exporters write both):
    transformers ties an equal head to the embedding and keeps a head with other values
    apart; the runtime does the same, on one tensor when tied."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    path, _ = save_model(tmp_path, "qwen2", tokenizer, tie_word_embeddings=True)
    weights = load_file(str(path / "model.safetensors"))
    assert "lm_head.weight" not in weights
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + offset
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    model = LLM(str(path)).model
    assert (model.embed.data_ptr() == model.lm_head.weight.data_ptr()) == (offset == 0.0)
    ids = torch.tensor([[5, 9, 13, 21]])
    with torch.no_grad():
        want = hf(ids).logits
        got = model.logits(model(ids, torch.arange(4).unsqueeze(0)))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
