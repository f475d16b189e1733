"""Runs the model for a batch of sequences: left-padded prefill into the KV cache,
then one decode step at a time for the whole batch, plus cache-free full forwards.

Left padding aligns every row on the same cache slot, so one step is one forward.
Each row's RoPE positions start at 0 at its first real token and pad slots are
masked out as keys, so a batched row computes what it would alone.
"""
from __future__ import annotations

import torch

from compress.runtime.kv_cache import KVCache
from compress.runtime.models.llama import LlamaFamilyModel


class ModelRunner:
    def __init__(self, model: LlamaFamilyModel, kv_dtype: torch.dtype | None = None):
        self.model = model
        self.kv_dtype = model.dtype if kv_dtype is None else kv_dtype  # the KV cache's element type
        self.device = model.device
        self.cache: KVCache | None = None
        self.length = 0             # slots filled (same for every row)
        self.pad: list[int] = []    # each row's left padding (its positions start after it)
        self.greedy_tokens: list[int] | None = None  # set by decode(greedy=True)
        self.key_valid: torch.Tensor | None = None   # [B, max_len] or None when no padding

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    def _ensure_cache(self, batch: int, max_len: int) -> None:
        if self.cache is None or not self.cache.fits(batch, max_len, self.kv_dtype):
            rows, slots = self.cache.capacity if self.cache is not None else (0, 0)
            self.cache = None  # free the old one first
            self.cache = KVCache(len(self.model.layers), max(batch, rows), self.model.n_kv_heads,
                                 max(max_len, slots), self.model.head_dim, self.kv_dtype, self.device)
        self.cache.batch = batch

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], max_len: int) -> torch.Tensor:
        """Fill the cache with ``prompts`` (room for ``max_len`` slots); logits ``[B, V]``
        for each prompt's last token."""
        longest = max(len(p) for p in prompts)
        if max_len > self.max_seq_len or longest > max_len:
            raise ValueError(f"need {max(max_len, longest)} positions, model allows {self.max_seq_len}")
        b = len(prompts)
        self._ensure_cache(b, max_len)
        pad = [longest - len(p) for p in prompts]
        ids = torch.zeros((b, longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, pad[i]:] = torch.as_tensor(p, dtype=torch.long)
        ids = ids.to(self.device)
        self.pad = list(pad)
        pad_t = torch.tensor(pad, device=self.device)
        slots = torch.arange(max_len, device=self.device)
        self.key_valid = (slots.unsqueeze(0) >= pad_t.unsqueeze(1)) if any(pad) else None
        positions = (slots[:longest].unsqueeze(0) - pad_t.unsqueeze(1)).clamp_(min=0)
        hidden = self.model(ids, positions, self.cache, 0,
                            None if self.key_valid is None else self.key_valid[:, :longest])
        self.length = longest
        return self.model.logits(hidden[:, -1])

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor | list[int], greedy: bool = False) -> torch.Tensor:
        """Append one token per row (``[B]``, a tensor or ints); logits ``[B, V]`` for the
        next one. ``greedy``: also leave each row's argmax token in ``greedy_tokens`` (a
        list; None where the model has no one-call decode step)."""
        if self.length >= self.cache.capacity[1]:
            raise RuntimeError("KV cache is full")
        s = self.length
        key_valid = None if self.key_valid is None else self.key_valid[:, :s + 1]
        self.greedy_tokens = None
        positions = [s - p for p in self.pad]
        if self.model.decodes_in_one_call:
            ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
            logits, self.greedy_tokens = self.model.decode_logits(ids, positions, self.cache, s, key_valid, greedy)
        else:
            ids = torch.as_tensor(tokens).to(self.device).view(-1, 1)
            hidden = self.model(ids, torch.tensor(positions, device=self.device).unsqueeze(1), self.cache, s,
                                key_valid)
            logits = self.model.logits(hidden[:, -1])
        self.length += 1
        return logits

    @property
    def capacity(self) -> int:
        return self.cache.capacity[1] if self.cache is not None else 0

    def keep(self, rows: list[int]) -> None:
        """Drop every row not in ``rows`` from the live batch."""
        self.cache.keep(rows, self.length)
        idx = torch.as_tensor(rows, device=self.device)
        self.pad = [self.pad[i] for i in rows]
        if self.key_valid is not None:
            self.key_valid = self.key_valid[idx]

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Cache-free forward of ``[B, T]`` tokens; ``attention_mask`` (1 = real token)
        may pad on either side. Final hidden states ``[B, T, H]``."""
        input_ids = input_ids.to(self.device)
        t = input_ids.shape[1]
        if t > self.max_seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_seq_len={self.max_seq_len}")
        if attention_mask is None or bool(attention_mask.all()):
            positions = torch.arange(t, device=self.device).expand(input_ids.shape[0], t)
            key_valid = None
        else:
            key_valid = attention_mask.to(self.device).bool()
            positions = (key_valid.long().cumsum(-1) - 1).clamp_(min=0)
        return self.model(input_ids, positions, None, 0, key_valid)
