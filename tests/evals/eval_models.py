"""Tiny offline models for the eval tests: a byte-level BPE tokenizer trained on a few
kilobytes of text and a random 2-layer Llama, saved with save_pretrained. (A module of its
own name: ``from conftest import`` finds whichever conftest is first on the path.)"""

from __future__ import annotations

import torch

SAMPLE = """Return the absolute value of the argument.
Open file and return a stream. Raise OSError upon failure.
The file is opened in text mode unless binary mode is requested.
Return a new list containing all items from the iterable in ascending order.
A custom key function can be supplied to customize the sort order.
Create a new dictionary with keys from iterable and values set to value.
"""


def make_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([SAMPLE] * 4, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")


def make_model_dir(path, seed: int = 0, max_positions: int = 128, noise: float = 0.0):
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = make_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                      pad_token_id=3, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger logits than the default init, so distributions differ
        model.lm_head.weight.mul_(20)
        if noise:
            for p in model.parameters():
                p.add_(noise * torch.randn_like(p))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
