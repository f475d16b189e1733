"""Helpers: tiny Llama / Mistral / Qwen2 checkpoints (random init) with a small trained BPE
tokenizer, saved to temporary directories; no downloads."""
from __future__ import annotations

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Python is a programming language that lets you work quickly.",
    "A list is a mutable sequence; a tuple is an immutable one.",
    "Hello world! Numbers like 12345 and symbols like {}[]() appear too.",
    "def main():\n    print('hello, world')\n",
] * 3


def make_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")






def tiny_config(family: str, vocab_size: int, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    if family == "mistral":
        common["sliding_window"] = None
    if family == "qwen3":   # as Qwen3's real sizes: head_dim is not hidden / heads (q_proj 64 -> 128)
        common.update(head_dim=32, sliding_window=None)
    common.update(overrides)
    return cls(**common)


def hf_model(config, seed: int = 0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    if getattr(config, "model_type", "") == "qwen2":   # biases start at zero; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.2)
    if getattr(config, "model_type", "") == "qwen3":   # q / k norm weights start at one; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)
    return model


def save_model(tmp_path, family: str, tokenizer, seed: int = 0, **overrides):
    config = tiny_config(family, len(tokenizer), **overrides)
    model = hf_model(config, seed)
    path = tmp_path / f"{family}-{seed}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model
