"""The timing core of ``compress bench spec``: the cost of one forward pass (a decode
step, a draft step, a (k+1)-token verify) on live sequences; the greedy decode runs
with and without the speculative step and the prompt windows are ``evals/decode_runs.py``'s.

Costs are taken where the speculative step takes them: ``ModelRunner.forward_tokens``
on sequences whose prompt is in the KV cache (one token per row: a decode or draft step;
``k + 1`` tokens per row with every position's logits: the verify pass).
"""
from __future__ import annotations

import torch

from compress.bench.timing import median_seconds
from compress.runtime.sampling import SamplingParams


class LiveRows:
    """``prompts`` prefilled in ``llm``'s engine (its speculative step off), so passes can
    be timed at the positions right after each prompt; ``close()`` frees them."""

    def __init__(self, llm, prompts: list[list[int]]):
        self.engine = llm.engine
        self.ids = [f"bench-spec-live-{id(self)}-{i}" for i in range(len(prompts))]
        saved, self.engine.speculative = self.engine.speculative, None
        try:
            for rid, prompt in zip(self.ids, prompts):
                self.engine.add_request(rid, prompt, SamplingParams(max_tokens=1 << 20, temperature=0.0,
                                                                    ignore_eos=True))
            self.seqs = [self.engine.requests[rid] for rid in self.ids]
            with torch.inference_mode():
                while any(not s.output_ids for s in self.seqs):
                    self.engine.step()
        finally:
            self.engine.speculative = saved

    def time_pass(self, tokens_per_row: int, repeats: int) -> float:
        """Median seconds of one ``forward_tokens`` pass bringing ``tokens_per_row`` tokens
        per row (``every_position`` when more than one: the verify pass)."""
        bm, runner = self.engine.block_manager, self.engine.runner
        for seq in self.seqs:
            bm.append_slots(seq, tokens_per_row)
        rows = [[seq.token_ids[-1]] * tokens_per_row for seq in self.seqs]
        starts = [seq.num_computed_tokens for seq in self.seqs]
        tables = [seq.block_table for seq in self.seqs]
        every = tokens_per_row > 1
        return median_seconds(lambda: runner.forward_tokens(rows, starts, tables, every_position=every), repeats)

    def close(self) -> None:
        for rid in self.ids:
            self.engine.abort(rid)


def pass_costs(llm, prompts: list[list[int]], ks: list[int], repeats: int) -> dict:
    """``{"step_s": a one-token pass, "verify_s": {k: a (k+1)-token pass}}`` over the rows
    of ``prompts`` (seconds, medians)."""
    live = LiveRows(llm, prompts)
    try:
        step = live.time_pass(1, repeats)
        verify = {k: live.time_pass(k + 1, repeats) for k in ks}
    finally:
        live.close()
    return {"step_s": step, "verify_s": verify}


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per target pass when each draft token is accepted with probability alpha:
    (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """Expected tokens per target pass over the step's cost in target decode steps, k c + v."""
    return expected_tokens(alpha, k) / (k * c + v)
