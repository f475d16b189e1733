"""Prefill and decode throughput of a checkpoint through the runtime.

Prefill: one forward over a ``prompt_len``-token prompt (time to the first new token).
Decode: the tokens after the first, divided by the time past the prefill. Both are the
median over ``repeats`` runs after ``warmup`` runs; batch 1, greedy, fixed prompt.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from evals.backend import sampling_params


@dataclass
class SpeedResult:
    prefill_tok_s: float
    decode_tok_s: float
    prompt_len: int
    new_tokens: int          # tokens decoded per run (median)
    repeats: int
    threads: int

    def to_dict(self) -> dict:
        return asdict(self)


def fixed_prompt(vocab_size: int, prompt_len: int, bos_id: int | None, seed: int = 0) -> list[int]:
    """A reproducible prompt of exactly ``prompt_len`` ids (BOS first when known)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(min(4, vocab_size - 1), vocab_size, (prompt_len,), generator=g).tolist()
    if bos_id is not None:
        ids[0] = bos_id
    return ids


def _timed_generate(llm, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    params = sampling_params(llm, max_tokens=max_tokens, temperature=0.0, seed=0)
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    return time.perf_counter() - t0, len(out.token_ids)


@torch.no_grad()
def measure_speed(llm, prompt_len: int = 128, new_tokens: int = 64, repeats: int = 3,
                  warmup: int = 1, prompt: list[int] | None = None) -> SpeedResult:
    tok = llm.tokenizer
    if prompt is None:
        prompt = fixed_prompt(len(tok), prompt_len, tok.bos_token_id)
    for _ in range(warmup):
        _timed_generate(llm, prompt, 1)
        _timed_generate(llm, prompt, new_tokens)
    prefill, total, counts = [], [], []
    for _ in range(repeats):               # alternate A B A B so drift hits both alike
        prefill.append(_timed_generate(llm, prompt, 1)[0])
        t, n = _timed_generate(llm, prompt, new_tokens)
        total.append(t)
        counts.append(n)
    t_prefill = statistics.median(prefill)
    n_dec = statistics.median(counts) - 1
    t_dec = statistics.median(total) - t_prefill
    return SpeedResult(
        prefill_tok_s=len(prompt) / t_prefill,
        decode_tok_s=n_dec / t_dec if n_dec > 0 and t_dec > 0 else float("nan"),
        prompt_len=len(prompt), new_tokens=int(statistics.median(counts)),
        repeats=repeats, threads=torch.get_num_threads())
