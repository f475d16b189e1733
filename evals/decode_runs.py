"""Greedy decode runs of one engine with and without a speculative step, and prompt
windows of a text: the measurements behind ``eval.speculative`` (``evals/speculative.py``)
and ``compress bench spec`` (``compress/bench/spec.py``). Pure measurement over the
runtime."""
from __future__ import annotations

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
