"""Runs the model for one engine step, and cache-free forwards for scoring.

A step's rows (``Sequence`` + how many of its tokens to compute) become one batch
descriptor (``step_batch.StepBatch``): one-token rows first, then prefill chunks, all
tokens flattened, so each linear is one GEMM over every row's tokens. Where the model
has a native one-call decode step (``native_decode.build_native_decode``, chosen once
at load) a step whose rows all bring one token runs through it instead (on a GPU: the
step's CUDA graph, ``cuda_graphs.DecodeGraphs``), and so does a step
of up to ``NATIVE_STEP_TOKENS`` tokens with prompt chunks (each chunk's tokens as one-token
rows, ``ModelRunner._native``); everything else runs the module path. Either way the step
returns the logits of each row whose tokens are now all computed (its next token is due).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from compress.runtime.kv_cache import PagedKVCache
from compress.runtime.models.llama import LlamaFamilyModel
from compress.runtime.sequence import Sequence
from compress.runtime.step_batch import block_table_tensor, build_step_batch


# A step (or a forward_tokens call) of up to this many tokens runs through the native plan
# as one-token rows, the head only on the rows whose logits are wanted; decode-only steps
# always do. Since attention takes a chunk's rows as one item (paged_attention.cpp), the
# native plan beat the module path at every size tried (2,048-token steps of 16 prompts
# 1.43x, one 2,000-token prompt 1.45-1.5x); the bound only keeps a step's per-row
# buffers within reason.
NATIVE_STEP_TOKENS = 8192


@dataclass
class StepOutput:
    """``seqs`` (the step's rows, one-token rows first) and, for the rows whose next token
    is due (``sampled``, indices into ``seqs``), fp32 ``logits [len(sampled), V]`` and,
    when asked for greedy tokens and the native step gave them, each one's argmax. Logits
    of a CUDA-graph step are a view of the graph's output, valid until the next step."""
    seqs: list[Sequence]
    num_new_tokens: list[int]
    sampled: list[int]
    logits: torch.Tensor | None
    greedy_tokens: list[int] | None = None


class ModelRunner:
    def __init__(self, model: LlamaFamilyModel, kv_cache: PagedKVCache | None, native=None, graphs=None):
        self.model = model
        self.kv_cache = kv_cache
        self.native = native        # a NativeDecode, or None: the module path runs every step
        self.graphs = graphs        # a cuda_graphs.DecodeGraphs (GPU decode steps), or None
        self.device = model.device

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    @property
    def kv_dtype(self) -> torch.dtype | None:
        return None if self.kv_cache is None else self.kv_cache.dtype

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_new_tokens: list[int], greedy: bool = False) -> StepOutput:
        """Computes ``num_new_tokens[i]`` tokens of ``seqs[i]`` from its
        ``num_computed_tokens`` on (the caller has secured their blocks; it advances
        ``num_computed_tokens`` afterwards)."""
        if num_new_tokens.count(1) == len(seqs):
            return self._one_token_rows(seqs, num_new_tokens, greedy)
        order = ([i for i, n in enumerate(num_new_tokens) if n == 1]
                 + [i for i, n in enumerate(num_new_tokens) if n != 1])
        if order != list(range(len(seqs))):
            seqs = [seqs[i] for i in order]
            num_new_tokens = [num_new_tokens[i] for i in order]
        sampled = [r for r, (s, n) in enumerate(zip(seqs, num_new_tokens))
                   if s.num_computed_tokens + n == s.num_tokens]
        cache = self.kv_cache
        if self.native is not None and sum(num_new_tokens) <= NATIVE_STEP_TOKENS:
            last = list(itertools.accumulate(num_new_tokens, initial=-1))[1:]   # each row's last token
            rows = [last[r] for r in sampled]
            logits, tokens = self._native([s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n]
                                           for s, n in zip(seqs, num_new_tokens)],
                                          [s.num_computed_tokens for s in seqs], [s.block_table for s in seqs],
                                          None if rows == list(range(last[-1] + 1)) else rows, greedy)
            return StepOutput(seqs, num_new_tokens, sampled, logits if sampled else None, tokens)
        batch = build_step_batch([s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n]
                                  for s, n in zip(seqs, num_new_tokens)],
                                 [s.num_computed_tokens for s in seqs], [s.block_table for s in seqs],
                                 cache.block_size, self.device)
        last = batch.last_token_index()
        if len(sampled) < len(seqs):
            last = last[sampled]
        logits = None
        hidden = self.model.forward_paged(batch, cache, last)
        if sampled:
            logits = self.model.logits(hidden)
        return StepOutput(seqs, num_new_tokens, sampled, logits)

    def _one_token_rows(self, seqs: list[Sequence], num_new_tokens: list[int], greedy: bool) -> StepOutput:
        """``run`` of a step whose rows all bring one token (decodes, and prompts' one-token
        chunks): the step's CUDA graph when every row wants its logits, else the native
        plan, else the module path. The rows' inputs are read off the sequences in one
        pass, no reordering needed."""
        starts = [s.num_computed_tokens for s in seqs]
        tokens = [s.token_ids[c] for s, c in zip(seqs, starts)]
        tables = [s.block_table for s in seqs]
        sampled = [r for r, (s, c) in enumerate(zip(seqs, starts)) if c + 1 == len(s.token_ids)]
        graphs = self.graphs
        if graphs is not None and len(sampled) == len(seqs) <= graphs.max_batch:
            return StepOutput(seqs, num_new_tokens, sampled, graphs.decode(tokens, starts, tables))
        if self.native is not None:
            logits, chosen = self.native.decode(tokens, starts, self.kv_cache.k, self.kv_cache.v,
                                                block_table_tensor(tables, self.device), greedy,
                                                None if len(sampled) == len(seqs) else sampled)
            return StepOutput(seqs, num_new_tokens, sampled, logits if sampled else None, chosen)
        batch = build_step_batch([[t] for t in tokens], starts, tables, self.kv_cache.block_size, self.device)
        last = None   # every row's hidden state
        if len(sampled) < len(seqs):
            last = torch.tensor(sampled, dtype=torch.int64, device=self.device)
        hidden = self.model.forward_paged(batch, self.kv_cache, last)
        return StepOutput(seqs, num_new_tokens, sampled, self.model.logits(hidden) if sampled else None)

    @torch.inference_mode()
    def forward_tokens(self, tokens: list[list[int]], starts: list[int], tables: list,
                       wanted: list[int] | None = None, every_position: bool = False) -> torch.Tensor:
        """Computes rows of tokens outside the scheduler's plain steps (speculative
        decoding): row r brings ``tokens[r]`` at positions ``starts[r] ..`` into the
        blocks ``tables[r]`` (already allocated). Returns the fp32 logits of the last
        ``wanted[r]`` tokens of each row, rows in order (``[sum(wanted), V]``; default:
        each row's last token; ``every_position``: all of them, a verify pass).

        With the native plan (``NATIVE_STEP_TOKENS`` tokens in all at most) the rows run
        as one-token rows (``_native``), the head only on the wanted positions; else the
        module path."""
        lens = [len(t) for t in tokens]
        wanted = lens if every_position else [1] * len(tokens) if wanted is None else list(wanted)
        if self.native is not None and sum(lens) <= NATIVE_STEP_TOKENS:
            picked = [end - j for end, w in zip(itertools.accumulate(lens), wanted) for j in range(w, 0, -1)]
            return self._native(tokens, starts, tables, None if wanted == lens else picked, False)[0]
        order = [r for r, n in enumerate(lens) if n == 1] + [r for r, n in enumerate(lens) if n != 1]
        batch = build_step_batch([tokens[r] for r in order], [starts[r] for r in order], [tables[r] for r in order],
                                 self.kv_cache.block_size, self.device)
        ends = batch.query_start[1:].tolist()
        at = {r: i for i, r in enumerate(order)}     # caller's row -> its place in the batch
        picked = [ends[at[r]] - j for r in range(len(tokens)) for j in range(wanted[r], 0, -1)]
        if not picked:
            self.model.forward_paged(batch, self.kv_cache, torch.empty(0, dtype=torch.long, device=self.device))
            return torch.empty(0, self.model.vocab_size)
        hidden = self.model.forward_paged(batch, self.kv_cache, torch.tensor(picked, device=self.device))
        return self.model.logits(hidden)

    def _native(self, tokens: list[list[int]], starts: list[int], tables: list, logit_rows: list[int] | None,
                greedy: bool) -> tuple[torch.Tensor, list[int] | None]:
        """Rows of tokens through the native plan as one-token rows: row r's tokens at
        positions ``starts[r] ..`` over its block table ``tables[r]`` (each layer writes
        every row's key and value before any row attends, so a row sees the keys of the
        tokens before it in the same call: causal attention over the chunk). The logits (and
        greedy tokens) of the flattened rows ``logit_rows`` (None: all)."""
        ids = [t for row in tokens for t in row]
        positions = [s + j for s, row in zip(starts, tokens) for j in range(len(row))]
        repeated = block_table_tensor([tables[r] for r, row in enumerate(tokens) for _ in row], self.device)
        return self.native.decode(ids, positions, self.kv_cache.k, self.kv_cache.v, repeated, greedy, logit_rows)

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
        return self.model(input_ids, positions, key_valid)
