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

from compress.config import ConfigError
from evals.backend import model_context, sampling_params


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


def _timed_generate(llm, prompt: list[int], max_tokens: int) -> tuple[float, int, dict]:
    params = sampling_params(llm, max_tokens=max_tokens, temperature=0.0, seed=0,
                             ignore_eos=True)
    reset = getattr(llm, "reset_prefix_cache", None)
    if reset is not None:  # the runtime caches prompt prefixes: each run computes its prompt
        reset()
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    return time.perf_counter() - t0, len(out.token_ids), dict(getattr(out, "metrics", None) or {})


@torch.no_grad()
def measure_speed(llm, prompt_len: int = 128, new_tokens: int = 64, repeats: int = 3,
                  warmup: int = 1, prompt: list[int] | None = None) -> SpeedResult:
    """Median prefill and decode tokens/s. Uses the runtime's own per-phase timings
    (``RequestOutput.metrics``) when it reports them, else wall time of a 1-token
    generation (prefill) against a ``new_tokens`` one, taken alternately."""
    tok = llm.tokenizer
    if prompt is None:
        prompt = fixed_prompt(len(tok), prompt_len, tok.bos_token_id)
    context = model_context(llm)
    if len(prompt) + new_tokens > context:
        raise ConfigError(f"a prompt of {len(prompt)} tokens and {new_tokens} new tokens do not fit "
                          f"the model's context of {context} tokens", "speed")
    for _ in range(warmup):
        _timed_generate(llm, prompt, new_tokens)
    prefill, decode, counts = [], [], []
    for _ in range(repeats):
        t, n, m = _timed_generate(llm, prompt, new_tokens)
        counts.append(n)
        if "prefill_s" in m and "decode_s" in m:
            prefill.append(len(prompt) / m["prefill_s"])
            steps = m.get("decode_steps", n - 1)
            decode.append(steps / m["decode_s"] if steps and m["decode_s"] > 0 else float("nan"))
        else:                               # A B A B: 1-token run, then the full run
            t1 = _timed_generate(llm, prompt, 1)[0]
            prefill.append(len(prompt) / t1)
            decode.append((n - 1) / (t - t1) if n > 1 and t > t1 else float("nan"))
    return SpeedResult(
        prefill_tok_s=statistics.median(prefill), decode_tok_s=statistics.median(decode),
        prompt_len=len(prompt), new_tokens=int(statistics.median(counts)),
        repeats=repeats, threads=torch.get_num_threads())
