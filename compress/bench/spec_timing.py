"""The timing core of ``compress bench spec``: prompt windows from the eval text, the cost
of one forward pass (a decode step, a draft step, a (k+1)-token verify) on live
sequences, and greedy decode runs of one engine with and without its speculative step.

Costs are taken where the speculative step takes them: ``ModelRunner.forward_tokens``
on sequences whose prompt is in the KV cache (one token per row: a decode or draft step;
``k + 1`` tokens per row with every position's logits: the verify pass).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compress.runtime.sampling import SamplingParams


def prompt_windows(llm, text_path: Path, count: int, prompt_len: int) -> list[list[int]]:
    """``count`` windows of ``prompt_len`` tokens of the text, spread over it (each starts
    with BOS where the model has one)."""
    ids = llm.encode(Path(text_path).read_text(), add_special_tokens=False)
    bos = [llm.bos_token_id] if llm.bos_token_id is not None else []
    body = prompt_len - len(bos)
    if len(ids) < count * body:
        raise ValueError(f"{text_path}: {len(ids)} tokens cannot give {count} windows of {prompt_len}")
    stride = (len(ids) - body) // max(count, 1)
    return [bos + ids[i * stride:i * stride + body] for i in range(count)]


def _median_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


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
        return _median_time(lambda: runner.forward_tokens(rows, starts, tables, every_position=every), repeats)

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


@dataclass
class DecodeRun:
    """One greedy decode of a batch: every row's tokens, the tokens made after each row's
    first (the decode), its seconds (first token of the batch done to the last row
    finished), and the speculative counters of the run (``None`` for the target alone)."""
    token_ids: list[list[int]]
    decode_tokens: int
    seconds: float
    spec: dict | None = field(default=None)

    @property
    def tok_s(self) -> float:
        return self.decode_tokens / self.seconds if self.seconds > 0 else float("nan")


_RUN_IDS = iter(range(1 << 62))


def decode_run(llm, prompts: list[list[int]], new_tokens: int, speculative=None) -> DecodeRun:
    """Greedy decode of ``new_tokens`` per prompt (EOS ignored) with ``speculative`` (a
    ``SpeculativeDecoder``) as the engine's speculative step, or none. The prefill steps
    (until every row has its first token) are not timed; the draft catching up on the
    prompt at the first speculative step is."""
    engine = llm.engine
    saved, engine.speculative = engine.speculative, speculative
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"bench-spec-{next(_RUN_IDS)}" for _ in prompts]
    try:
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        seqs = [engine.requests[rid] for rid in ids]
        with torch.inference_mode():
            while any(not s.output_ids for s in seqs):
                engine.step()
            first = sum(len(s.output_ids) for s in seqs)
            t = time.perf_counter()
            while any(not s.finished for s in seqs):
                engine.step()
            seconds = time.perf_counter() - t
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.speculative = saved
    tokens = [list(s.output_ids) for s in seqs]
    return DecodeRun(tokens, sum(len(t) for t in tokens) - first, seconds,
                     None if speculative is None else speculative.stats_dict())


class CountingDrafter:
    """A drafter passed through, counting what the geometric model of acceptance needs:
    rows that proposed tokens, and among them the rows where the target rejected one
    (kept fewer than proposed). The per-token acceptance rate is then
    accepted / (accepted + rejections); accepted / proposed (the engine's
    ``spec_acceptance_rate``) also counts the tokens after a rejection, never verified.
    ``bind(decoder)`` before use: a row's kept tokens are read off the decoder's counter,
    which it updates just before it calls ``after_step`` for that row."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.decoder = None
        self.pending: dict[str, int] = {}
        self.rows_proposing = 0
        self.rejections = 0
        self._accepted = 0

    def bind(self, decoder):
        self.decoder = decoder
        self._accepted = decoder.stats.accepted_tokens
        return decoder

    @property
    def forwards(self) -> int:
        return getattr(self.inner, "forwards", 0)

    def propose(self, seqs, ks):
        proposal = self.inner.propose(seqs, ks)
        for seq, tokens, k in zip(seqs, proposal.tokens, ks):
            self.pending[seq.request_id] = min(len(tokens), k)
        return proposal

    def after_step(self, seq) -> None:
        kept = self.decoder.stats.accepted_tokens - self._accepted
        self._accepted = self.decoder.stats.accepted_tokens
        proposed = self.pending.pop(seq.request_id, 0)
        if proposed:
            self.rows_proposing += 1
            self.rejections += kept < proposed
        self.inner.after_step(seq)

    def release(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.inner.release(request_id)

    def stats(self) -> dict:
        return {**self.inner.stats(), "rows_proposing": self.rows_proposing, "rejections": self.rejections}


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per target pass when each draft token is accepted with probability alpha:
    (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """Expected tokens per target pass over the step's cost in target decode steps, k c + v."""
    return expected_tokens(alpha, k) / (k * c + v)
