"""Iteration-level scheduling (Orca) with chunked prefill (SARATHI): which sequences
run in the next step, and how many of their tokens.

Each step has a token budget (``max_num_batched_tokens``) and a cap on running sequences
(``max_num_seqs``). Running sequences come first, oldest first: a decode takes one token,
a prompt being prefilled in chunks takes what is left of it (up to the budget). Waiting
sequences are admitted next, first come first served, while the budget, the sequence cap
and the free KV blocks allow: a prefix-cache hit counts as computed, the rest of the
prompt is this step's chunk. Without chunked prefill a prompt runs whole in one step;
one longer than what is left of the budget is admitted only as the step's first prompt.

``max_prefill_tokens_with_decodes`` (chunked prefill only; default None, no cap): in a
step that also runs decodes, the prompt chunks take at most that many tokens in all, so
the step, and with it every running request's inter-token gap, stays near a decode
step's length while a long prompt comes in (Sarathi-Serve's stall-free batching with a
token budget sized for the latency target rather than for throughput).

When a running sequence needs a block and none is free, the newest running sequence is
preempted by recompute: it gives back its blocks and goes back to the front of the
waiting queue, to be prefilled again (its generated tokens included) when there is room.
No sequence is admitted in a step that preempted. A sequence longer than the whole pool
finishes with 'length'.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from compress.runtime.block_manager import BlockManager
from compress.runtime.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step: ``seqs[i]`` computes its next ``num_new_tokens[i]`` tokens (positions
    ``num_computed_tokens .. + n - 1``). ``preempted``: sent back to waiting in this
    step; ``finished``: ended by the scheduler (too long for the KV pool)."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 enable_chunked_prefill: bool = True, max_prefill_tokens_with_decodes: int | None = None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs (max_batch_size) must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_prefill_tokens_with_decodes is not None and max_prefill_tokens_with_decodes < 1:
            raise ValueError(f"max_prefill_tokens_with_decodes must be >= 1 (or None), got "
                             f"{max_prefill_tokens_with_decodes}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Drops a finished (or aborted) sequence and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    # ------------------------------------------------------------------ one step
    def schedule(self, decode_only: bool = False) -> ScheduledBatch:
        """The next step's rows. ``decode_only`` (chunked prefill): a step that runs
        decodes takes no prompt tokens (``PrefillCap`` measuring its baseline); a step
        without decodes is unchanged."""
        bm = self.block_manager
        out = ScheduledBatch()
        budget = self.max_num_batched_tokens
        running = self.running
        # prompt tokens this step may still take (None: only the budget counts)
        prefill_left = None
        if (self.enable_chunked_prefill and (decode_only or self.max_prefill_tokens_with_decodes is not None)
                and any(s.num_tokens - s.num_computed_tokens == 1 for s in running)):
            prefill_left = 0 if decode_only else self.max_prefill_tokens_with_decodes
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            n = min(remaining, budget)
            if remaining > 1 and prefill_left is not None:  # a prompt's next chunk
                n = min(n, prefill_left)
                if n == 0:
                    i += 1  # runs on in a later step
                    continue
                prefill_left -= n
            blocks = bm.blocks_for(seq.num_computed_tokens + n)
            if blocks > bm.num_blocks:
                self._too_long(seq, out)
                continue
            while blocks > len(seq.block_table) and not bm.can_append(seq, n):   # (most steps take no block)
                victim = running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                if blocks > len(seq.block_table):
                    bm.append_slots(seq, n)
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            break  # seq preempted itself: nothing after it is running
        if out.preempted:
            return out
        prefill_scheduled = False
        while self.waiting and budget > 0 and len(running) < self.max_num_seqs:
            seq = self.waiting[0]
            if bm.blocks_for(seq.num_tokens) > bm.num_blocks:
                self._too_long(seq, out)
                continue
            hits = bm.cached_prefix(seq)
            n = seq.num_tokens - len(hits) * bm.block_size
            if self.enable_chunked_prefill:
                n = min(n, budget if prefill_left is None else min(budget, prefill_left))
                if n == 0:
                    break
            elif n > budget and prefill_scheduled:
                break
            if not bm.can_allocate(hits, len(hits) * bm.block_size + n):
                break
            self.waiting.popleft()
            bm.allocate(seq, hits, n)
            if seq.first_scheduled_time is None:
                seq.num_cached_tokens = seq.num_computed_tokens
                seq.first_scheduled_time = time.perf_counter()
            seq.status = SequenceStatus.RUNNING
            running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
            if prefill_left is not None:
                prefill_left -= n
            prefill_scheduled = True
        return out

    def _preempt(self, seq: Sequence, out: ScheduledBatch) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _too_long(self, seq: Sequence, out: ScheduledBatch) -> None:
        """``seq`` cannot fit the whole KV pool: it ends here."""
        self.finish(seq)
        seq.finish("length")
        out.finished.append(seq)
