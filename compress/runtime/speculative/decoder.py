"""The engine's speculative step: draft, verify in one target pass, accept, roll back.

A step whose rows are all decodes (each sequence has exactly its last token left to
compute) runs speculatively; a step with a prefill chunk runs as usual (the draft
catches up on the prompt at its next speculative step). For each row:

1. ``k_r`` draft tokens at most: ``num_speculative_tokens``, fewer where ``max_tokens``,
   the model's length or the free KV blocks leave less room;
2. the drafter proposes ``d_1 .. d_k`` (``model_drafter.py``, ``ngram_drafter.py``);
3. the target computes ``[last, d_1 .. d_k]`` at their positions in one pass
   (``ModelRunner.forward_tokens``: the native batched decode plan with per-row
   positions where the model has it), giving ``k + 1`` distributions;
4. modified rejection sampling (``rejection.py``) keeps ``m`` draft tokens and adds one;
   the tokens are appended one at a time, so EOS, stop strings and ``max_tokens`` end
   the sequence exactly where plain decoding would;
5. KV rollback: the target counts ``n + m`` computed positions (``last, d_1 .. d_m``),
   the blocks past what the sequence needs go back to the pool, and the drafter keeps
   only positions whose tokens were kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compress.runtime.sequence import RequestOutput, Sequence, TokenLogprob
from compress.runtime.speculative.rejection import target_probs, verify_greedy, verify_sampled
from compress.runtime.sampling import token_logprobs_topk


@dataclass
class SpecStats:
    steps: int = 0                 # speculative steps
    rows: int = 0                  # sequence-steps among them
    draft_tokens: int = 0          # tokens proposed
    accepted_tokens: int = 0       # of those, kept
    emitted_tokens: int = 0        # tokens appended (accepted + recovered / bonus, up to a stop)
    accepted_hist: list[int] = field(default_factory=list)   # rows that kept m tokens, by m

    def as_dict(self) -> dict:
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else None
        return {"spec_steps": self.steps, "spec_rows": self.rows, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens, "spec_emitted_tokens": self.emitted_tokens,
                "spec_acceptance_rate": rate,
                "spec_mean_tokens_per_row_step": self.emitted_tokens / self.rows if self.rows else None,
                "spec_accepted_hist": list(self.accepted_hist)}


class SpeculativeDecoder:
    def __init__(self, drafter, num_speculative_tokens: int):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.drafter = drafter
        self.k = int(num_speculative_tokens)
        self.stats = SpecStats(accepted_hist=[0] * (self.k + 1))

    @staticmethod
    def applies(seqs: list[Sequence], num_new_tokens: list[int]) -> bool:
        """Whether every row is a decode (its last token is all it has left to compute)."""
        return all(n == 1 and s.num_computed_tokens + 1 == s.num_tokens for s, n in zip(seqs, num_new_tokens))

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)

    def stats_dict(self) -> dict:
        return {"spec_method": self.drafter.name, "spec_k": self.k, **self.stats.as_dict(), **self.drafter.stats()}

    def _room(self, engine, seq: Sequence) -> int:
        """Draft tokens this row can take: its k, less where max_tokens, the model's
        length or the free KV blocks leave less room (the scheduler reserved one slot)."""
        k = min(self.k, seq.params.max_tokens - len(seq.output_ids) - 1, engine.max_seq_len - seq.num_tokens - 1)
        bm = engine.block_manager
        while k > 0 and not bm.can_append(seq, 1 + k):
            k -= 1
        return max(k, 0)

    def step(self, engine, seqs: list[Sequence]) -> list[RequestOutput]:
        bm = engine.block_manager
        ks = [self._room(engine, s) for s in seqs]
        proposal = self.drafter.propose(seqs, ks)
        drafts = [t[:k] for t, k in zip(proposal.tokens, ks)]
        for seq, d in zip(seqs, drafts):
            bm.append_slots(seq, 1 + len(d))
        rows = [[seq.token_ids[-1]] + d for seq, d in zip(seqs, drafts)]
        logits = engine.runner.forward_tokens(rows, [s.num_computed_tokens for s in seqs],
                                              [s.block_table for s in seqs], every_position=True)
        st = self.stats
        st.steps += 1
        outputs = []
        at = 0
        for r, (seq, draft) in enumerate(zip(seqs, drafts)):
            row_logits = logits[at:at + len(draft) + 1]
            at += len(draft) + 1
            p = seq.params
            if p.greedy:
                verdict = verify_greedy(draft, row_logits)
            else:
                q = proposal.probs_of(r)
                verdict = verify_sampled(draft, None if q is None else q[:len(draft)],
                                         target_probs(row_logits, p.temperature, p.top_k, p.top_p), seq.generator)
            st.rows += 1
            st.draft_tokens += len(draft)
            st.accepted_tokens += verdict.num_accepted
            st.accepted_hist[verdict.num_accepted] += 1
            base = seq.num_tokens
            engine.tokens_decoded += 1 + len(draft)
            lps = self._logprobs(seq, row_logits, verdict.tokens)
            for token, lp in zip(verdict.tokens, lps):
                seq.append(token, lp)
                st.emitted_tokens += 1
                engine.tokens_generated += 1
                if not seq.finished and seq.num_tokens >= engine.max_seq_len:
                    seq.finish("length")
                if seq.finished:
                    break
            # computed: the old last token and the kept draft tokens now in the sequence
            seq.num_computed_tokens = min(base + verdict.num_accepted, seq.num_tokens - 1)
            self.drafter.after_step(seq)
            if seq.finished:
                outputs.append(engine._finished(seq))
                continue
            bm.trim(seq)
            bm.register_full_blocks(seq)
            outputs.append(seq.output())
        return outputs

    @staticmethod
    def _logprobs(seq: Sequence, row_logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob | None]:
        if seq.params.logprobs is None:
            return [None] * len(tokens)
        found = token_logprobs_topk(row_logits[:len(tokens)], tokens, [int(seq.params.logprobs)] * len(tokens))
        return [TokenLogprob(t, lp, top) for t, (lp, top) in zip(tokens, found)]
