"""Tiny Hugging Face models and tokenizers built on the fly for tests (no downloads).

``make_tiny_model(dir, "llama")`` writes a random-init model of the named family
plus a small byte-level BPE tokenizer trained on Python's own builtin docstrings.
"""
from __future__ import annotations

import builtins
import functools
from pathlib import Path

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def corpus_text() -> str:
    docs = [getattr(builtins, n).__doc__ or "" for n in sorted(dir(builtins))]
    return "\n\n".join(d for d in docs if len(d) > 40)


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([corpus_text()], trainer)
    return tok.to_str()


def make_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_tokenizer_json(vocab_size))
    tok.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                            special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")


def tiny_config(family: str = "llama", **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    kw = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, bos_token_id=0,
              eos_token_id=1, tie_word_embeddings=False)
    if family == "qwen3":   # head_dim is not hidden / heads, as in Qwen3's real sizes
        kw.update(head_dim=64)
    kw.update(overrides)
    return cls(**kw)


def make_tiny_model(path: Path, family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32,
                    max_shard_size: str | int | None = None, **overrides) -> Path:
    """Save a random tiny ``family`` model + tokenizer into ``path`` (stored as ``dtype``,
    sharded by transformers when ``max_shard_size`` is given); returns ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    model.eval().to(dtype)
    with torch.no_grad():   # Qwen3's q / k norm weights start at one: make them matter
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    path = Path(path)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    make_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path
