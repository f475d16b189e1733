"""A draft model that proposes tokens for the target: its own paged KV cache, block
pool and model runner, in lock-step with the target's sequences.

Per request the drafter keeps a block table and how many of the sequence's leading
tokens its cache holds. A step first brings each sequence's uncomputed tokens into the
draft cache (after a prompt: the whole prompt, as one chunk; after a speculative step:
the one new token), which gives the first draft token, then runs ``k - 1`` one-token
steps (the native batched decode plan where the draft allows it). After the target has
verified, the draft's cache counts only the positions whose tokens the target kept
(KV rollback: later positions are overwritten by the next step).
"""
from __future__ import annotations

from array import array

import torch

from compress.runtime.block_manager import BlockManager
from compress.runtime.kv_cache import PagedKVCache
from compress.runtime.model_runner import ModelRunner
from compress.runtime.sequence import Sequence
from compress.runtime.speculative.proposal import Proposal
from compress.runtime.speculative.rejection import target_probs


class DraftState:
    """A request's place in the draft cache (shaped like a ``Sequence`` for the block
    manager): ``num_computed_tokens`` leading tokens of the sequence are in the draft's
    cache; ``base`` and ``drafted``: the last step's starting length and its tokens."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.block_table = array("i")
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0
        self.base = 0
        self.drafted: list[int] = []


def check_draft_vocab(draft_vocab: int, target_vocab: int, name) -> None:
    """A ValueError naming ``name`` when the draft's vocabulary is not the target's size."""
    if draft_vocab != target_vocab:
        raise ValueError(f"speculative: the draft {name} has a vocabulary of {draft_vocab} tokens, the "
                         f"target {target_vocab}; a draft must share the target's tokenizer")


class ModelDrafter:
    """``model``: a ``LlamaFamilyModel`` with the target's vocabulary; ``num_tokens``:
    positions its paged cache holds in all (the target's cache size by default)."""

    name = "model"

    def __init__(self, model, num_tokens: int, block_size: int = 16, kv_cache_dtype=None, native_decode: bool = True):
        from compress.runtime.llm_engine import _native_decode

        self.model = model
        kv_dtype = kv_cache_dtype or model.dtype   # PagedKVCache checks it (names too)
        num_blocks = max(1, -(-int(num_tokens) // block_size))
        self.kv_cache = PagedKVCache(len(model.layers), num_blocks, model.n_kv_heads, block_size, model.head_dim,
                                     kv_dtype, model.device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, self.kv_cache, _native_decode(model) if native_decode else None)
        self.states: dict[str, DraftState] = {}
        self.forwards = 0       # draft forward passes (steps of the draft model)

    @classmethod
    def for_target(cls, model, engine, native_decode: bool = True, name: str = "draft") -> "ModelDrafter":
        """A drafter of ``model`` for ``engine``'s target: the same vocabulary (else a
        ValueError naming ``name``), a paged cache of as many positions as the target's,
        in its blocks and element type."""
        check_draft_vocab(model.vocab_size, engine.model.vocab_size, name)
        return cls(model, engine.kv_cache.num_tokens, engine.block_manager.block_size, engine.kv_cache.dtype,
                   native_decode)

    def _state(self, seq: Sequence) -> DraftState:
        state = self.states.get(seq.request_id)
        if state is None:
            state = self.states[seq.request_id] = DraftState(seq.request_id)
        return state

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        bm = self.block_manager
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        rows, kk = [], []
        for r, (seq, k) in enumerate(zip(seqs, ks)):
            k = min(k, self.model.max_seq_len - seq.num_tokens + 1)
            if k < 1:
                continue
            state = self._state(seq)
            state.num_computed_tokens = min(state.num_computed_tokens, seq.num_tokens - 1)
            # positions up to num_tokens + k - 2 are written (the last draft token is not run)
            need = seq.num_tokens + k - 1 - state.num_computed_tokens
            if not bm.can_append(state, need):
                continue
            bm.append_slots(state, need)
            state.base, state.drafted = seq.num_tokens, []
            rows.append(r)
            kk.append(k)
        if not rows:
            return Proposal(tokens, None)
        sampled = any(not seqs[r].params.greedy for r in rows)
        # step 0: everything not yet in the draft cache, up to the sequence's last token
        feed = [seqs[r].token_ids[self.states[seqs[r].request_id].num_computed_tokens:] for r in rows]
        active = list(range(len(rows)))
        for i in range(max(kk)):
            states = [self.states[seqs[rows[a]].request_id] for a in active]
            logits = self.runner.forward_tokens(feed, [s.num_computed_tokens for s in states],
                                                [s.block_table for s in states])
            self.forwards += 1
            for j, (a, state) in enumerate(zip(active, states)):
                seq = seqs[rows[a]]
                state.num_computed_tokens += len(feed[j])
                token = self._pick(seq, logits[j], probs[rows[a]])
                tokens[rows[a]].append(token)
                state.drafted.append(token)
            active = [a for a in active if kk[a] > i + 1]
            if not active:
                break
            feed = [[tokens[rows[a]][-1]] for a in active]
        return Proposal(tokens, [torch.stack(p) if p else None for p in probs] if sampled else None)

    @staticmethod
    def _pick(seq: Sequence, logits: torch.Tensor, probs_out: list) -> int:
        params = seq.params
        if params.greedy:
            return int(torch.ops.compress.argmax_rows(logits.view(1, -1).float().contiguous())[0])
        q = target_probs(logits.view(1, -1), params.temperature, params.top_k, params.top_p)[0]
        probs_out.append(q)
        return int(torch.multinomial(q, 1, generator=seq.generator))

    def after_step(self, seq: Sequence) -> None:
        """The target has kept some of the drafted tokens: the draft cache keeps the
        positions whose tokens are now the sequence's."""
        state = self.states.get(seq.request_id)
        if state is None or not state.drafted:
            return
        kept = 0
        ids, base = seq.token_ids, state.base
        while (kept < len(state.drafted) and base + kept < len(ids) and ids[base + kept] == state.drafted[kept]):
            kept += 1
        state.num_computed_tokens = min(state.num_computed_tokens, base + kept)
        state.drafted = []

    def release(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.block_manager.free(state)

    def stats(self) -> dict:
        return {"draft_forwards": self.forwards, "draft_kv_blocks_used": self.block_manager.num_used_blocks}
