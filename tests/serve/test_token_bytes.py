"""A token's own bytes, for the tokenizer families real checkpoints ship."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from compress.serve.token_bytes import decoder_kind, token_bytes_fn
from conftest import EMBEDDED

TEXT = "the fox é 𝔘"


@pytest.fixture(scope="module")
def sentencepiece_style():
    """A Llama-2-style tokenizer: Metaspace pieces, byte fallback, the decoder that strips
    the text's first space (what LlamaTokenizerFast builds from a tokenizer.model)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["\u2581", "t", "h", "e", "f", "o", "x", "th", "the", "\u2581the", "\u2581f", "\u2581fo", "\u2581fox"]:
        vocab[piece] = len(vocab)
    merges = [("t", "h"), ("th", "e"), ("\u2581", "the"), ("\u2581", "f"), ("\u2581f", "o"), ("\u2581fo", "x")]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_pieces_keep_their_space_and_byte_fallback_its_byte(sentencepiece_style):
    tok = sentencepiece_style
    assert decoder_kind(tok) == "sentencepiece"
    of = token_bytes_fn(tok)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    pieces = [of(i) for i in ids]
    assert pieces[:2] == [b" the", b" fox"]                # decode([id]) alone gives "the", "fox"
    assert b"\xc3" in pieces and b"\xa9" in pieces          # é by byte fallback, a byte a token
    assert b"".join(pieces) == (" " + TEXT).encode()        # the text, with the space the decoder strips
    assert of(tok.bos_token_id) == b"<s>"


def test_byte_level_tokens_give_their_raw_bytes():
    tok = AutoTokenizer.from_pretrained(str(EMBEDDED))
    assert decoder_kind(tok) == "byte_level"
    of = token_bytes_fn(tok)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    pieces = [of(i) for i in ids]
    assert b"".join(pieces) == TEXT.encode()
    assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)   # a part of a character, not U+FFFD's 3 bytes
    assert of(tok.eos_token_id) == tok.eos_token.encode()
