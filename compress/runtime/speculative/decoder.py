"""The engine's speculative step: draft, verify in one target pass, accept, roll back.

The decode rows of a step (each sequence has exactly its last token left to compute)
run speculatively; the step's prefill chunks run in the same target pass as they would
in a plain step (the draft catches up on a prompt at the sequence's first speculative
step). A step without a decode row is left to the engine. For each decode row:

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

from compress.runtime.sequence import RequestOutput, Sequence
from compress.runtime.speculative.rejection import target_probs, verify_greedy, verify_sampled


@dataclass
class SpecStats:
    steps: int = 0                 # speculative steps
    rows: int = 0                  # sequence-steps among them
    draft_tokens: int = 0          # tokens proposed
    accepted_tokens: int = 0       # of those, kept
    emitted_tokens: int = 0        # tokens appended (accepted + recovered / bonus, up to a stop)
    rejections: int = 0            # rows whose draft the target cut short
    accepted_hist: list[int] = field(default_factory=list)   # rows that kept m tokens, by m

    def as_dict(self) -> dict:
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else None
        # per token: the chance that the next draft token is kept (tokens after a rejection
        # are never judged), the alpha of (1 - alpha^(k+1)) / (1 - alpha)
        judged = self.accepted_tokens + self.rejections
        return {"spec_steps": self.steps, "spec_rows": self.rows, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens, "spec_emitted_tokens": self.emitted_tokens,
                "spec_acceptance_rate": rate, "spec_rejections": self.rejections,
                "spec_acceptance_per_token": self.accepted_tokens / judged if judged else None,
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
    def is_decode(seq: Sequence, n: int) -> bool:
        """Whether the row brings its last token (a decode, not a prefill chunk)."""
        return n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens

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

    def step(self, engine, seqs: list[Sequence], num_new_tokens: list[int]) -> list[RequestOutput] | None:
        """One engine step with speculation for its decode rows; its prefill chunks run
        in the same pass as they would in a plain step. None when the step has no decode
        row or a row whose logits a penalty or a logit bias changes (the engine runs it as usual)."""
        decode = [r for r, (s, n) in enumerate(zip(seqs, num_new_tokens)) if self.is_decode(s, n)]
        if not decode or any(s.params.modifies_logits for s in seqs):  # penalties, bias: the plain step samples
            return None
        bm = engine.block_manager
        ks = []
        for r in decode:   # each row's room taken before the next row's is sized: one pool for all
            ks.append(self._room(engine, seqs[r]))
            bm.append_slots(seqs[r], 1 + ks[-1])   # a shorter proposal's spare blocks go back in _accept
        proposal = self.drafter.propose([seqs[r] for r in decode], ks)
        drafts: dict[int, tuple[list[int], torch.Tensor | None]] = {}   # row -> (tokens, their q or None)
        for j, r in enumerate(decode):
            drafts[r] = (proposal.tokens[j][:ks[j]], proposal.probs_of(j))
        rows, wanted = [], []
        for r, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            if r in drafts:
                rows.append([seq.token_ids[-1]] + drafts[r][0])
                wanted.append(len(rows[-1]))
            else:   # a prefill chunk: its last token's logits when the prompt is then complete
                rows.append(seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + n])
                wanted.append(1 if seq.num_computed_tokens + n == seq.num_tokens else 0)
        logits = engine.runner.forward_tokens(rows, [s.num_computed_tokens for s in seqs],
                                              [s.block_table for s in seqs], wanted)
        self.stats.steps += 1
        outputs, at, due = [], 0, []
        for r, seq in enumerate(seqs):
            row_logits = logits[at:at + wanted[r]]
            at += wanted[r]
            if r not in drafts:
                seq.num_computed_tokens += len(rows[r])
                engine.tokens_prefilled += len(rows[r])
                bm.register_full_blocks(seq)
                if wanted[r]:
                    due.append((seq, row_logits))
                continue
            outputs.append(self._accept(engine, seq, *drafts[r], row_logits))
        if due:
            outputs += engine.emit([s for s, _ in due], torch.cat([lg for _, lg in due]))
        return outputs

    def _accept(self, engine, seq: Sequence, draft: list[int], q: torch.Tensor | None,
                row_logits: torch.Tensor) -> RequestOutput:
        """Verdict on one decode row's draft, its tokens appended, both caches rolled back."""
        p = seq.params
        if p.greedy:
            verdict = verify_greedy(draft, row_logits)
        else:
            verdict = verify_sampled(draft, None if q is None else q[:len(draft)],
                                     target_probs(row_logits, p.temperature, p.top_k, p.top_p), seq.generator)
        st = self.stats
        st.rows += 1
        st.draft_tokens += len(draft)
        st.accepted_tokens += verdict.num_accepted
        st.accepted_hist[verdict.num_accepted] += 1
        st.rejections += verdict.num_accepted < len(draft)
        base = seq.num_tokens
        engine.tokens_decoded += 1 + len(draft)
        n = len(verdict.tokens)
        logprobs = engine.chosen_logprobs([seq] * n, row_logits[:n], verdict.tokens)
        for token, lp in zip(verdict.tokens, logprobs):
            st.emitted_tokens += 1
            if engine.append_token(seq, token, lp):
                break
        # computed: the old last token and the kept draft tokens now in the sequence
        seq.num_computed_tokens = min(base + verdict.num_accepted, seq.num_tokens - 1)
        self.drafter.after_step(seq)
        if seq.finished:
            return engine._finished(seq)
        engine.block_manager.trim(seq)
        engine.block_manager.register_full_blocks(seq)
        return seq.output()
