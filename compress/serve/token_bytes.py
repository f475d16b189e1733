"""The bytes one token stands for, whatever the tokenizer's family.

Decoding a single token id with ``tokenizer.decode([id])`` is wrong in two common cases:
- a token that holds part of a UTF-8 character (byte-level BPE pieces, SentencePiece's
  ``<0xC3>`` byte fallback) decodes to U+FFFD, so its ``bytes`` in a chat logprob lose
  what OpenAI documents them for (rebuilding characters split across tokens);
- a SentencePiece word piece ``▁the`` decodes to ``the``: the decoder strips the space a
  text starts with, and every token decoded alone is at a start.
So the bytes come from the token's own string (``convert_ids_to_tokens``), read by the
rules of the tokenizer's decoder:
- ByteLevel (GPT-2, Llama 3, Qwen): each character is one byte through GPT-2's printable
  byte map;
- SentencePiece style (Metaspace, or a ``Replace`` of ``▁``; Llama 2, Mistral, TinyLlama):
  ``<0xNN>`` is the byte NN, ``▁`` is a space, the rest is UTF-8;
- anything else, and special or added tokens: the text ``decode([id])`` gives, as UTF-8.
A token's text is then its bytes decoded with U+FFFD for an incomplete character.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Callable

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SP_SPACE = "\u2581"


@lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's map from the printable stand-in characters back to bytes: bytes that are
    printable Latin-1 stand for themselves, the other 68 are shifted to 256 and up."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def decoder_kind(tokenizer) -> str:
    """'byte_level', 'sentencepiece' or 'other', from a fast tokenizer's decoder spec."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "sentencepiece" if hasattr(tokenizer, "sp_model") else "other"
    try:
        spec = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:  # noqa: BLE001 - an unreadable spec: fall back to decode()
        return "other"
    text = json.dumps(spec, ensure_ascii=False)   # "▁" as itself, not \u2581
    if '"ByteLevel"' in text:
        return "byte_level"
    if '"Metaspace"' in text or SP_SPACE in text or '"ByteFallback"' in text:
        return "sentencepiece"
    return "other"


def token_bytes_fn(tokenizer) -> Callable[[int], bytes]:
    """A function from token id to that token's bytes (see the module's rules)."""
    kind = decoder_kind(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = set((getattr(tokenizer, "added_tokens_decoder", None) or {}).keys())
    byte_map = byte_level_decoder()

    def plain(token_id: int) -> bytes:
        return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8", "surrogatepass")

    def of(token_id: int) -> bytes:
        if kind == "other" or token_id in special or token_id in added:
            return plain(token_id)
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return plain(token_id)
        if kind == "byte_level":
            if all(ch in byte_map for ch in piece):
                return bytes(byte_map[ch] for ch in piece)
            return plain(token_id)
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace(SP_SPACE, " ").encode("utf-8")

    return of
