"""Stages of a recipe as speculative drafts of its base (the recipe's ``eval.speculative``).

For each draft, at batch 1 and greedy, on ``prompts`` windows of ``prompt_len`` tokens of
the eval text, ``new_tokens`` each: the target alone and the target with the draft
(``LLM(target, speculative={"model": draft, "num_speculative_tokens": k})``, the same
engine with its speculative step on and off), taken alternately -- per prompt, alone then
with the draft -- over ``rounds`` rounds. Figures:

* ``alpha``: acceptance per draft token, accepted / (accepted + rows that rejected one),
  the engine's ``spec_acceptance_per_token`` (a row rejected when the target kept fewer
  tokens than the draft proposed, so a row whose room was cut below k by ``max_tokens``
  is not counted as a rejection);
* ``tokens_per_pass``: tokens appended per verify pass of a sequence (accepted + the
  target's own), emitted / rows;
* ``target_tok_s`` / ``spec_tok_s``: decode tokens/s (tokens after the first over the
  time past the prefill), medians over the rounds; ``speedup``: the median of the rounds'
  ratios (each round's pair ran back to back);
* ``identical``: whether every greedy output with the draft equals the target's (it must:
  the step is lossless; a mismatch is an error cell, the figures are kept).

Pure measurement over the runtime: nothing here builds or changes a model.
"""
from __future__ import annotations

import logging
import statistics
from pathlib import Path

import torch

from evals.eval_config import SpeculativeEvalConfig

log = logging.getLogger(__name__)

CELL = "speculative"
COUNTERS = ("spec_rows", "spec_draft_tokens", "spec_accepted_tokens", "spec_emitted_tokens", "spec_rejections")


def measure_draft(target: str | Path, draft: str | Path, spec: SpeculativeEvalConfig, text: str | Path,
                  dtype: str = "float32", kernels: str = "native", w4_activations: str | None = None) -> dict:
    """The figures of ``draft`` as a speculative draft of ``target`` (see the module's doc).
    Raises when they cannot be measured (a draft of another vocabulary, a text too short)."""
    from compress.runtime.speculative import SpeculativeDecoder   # a fresh one per run: its counters start at 0
    from evals.decode_runs import decode_run, prompt_windows
    from compress.runtime import LLM

    if kernels == "transformers":
        raise ValueError("speculative decoding runs on the runtime: eval.kernels must be native or reference")
    kw = {} if w4_activations is None else {"w4_activations": w4_activations}
    llm = LLM(str(target), dtype=dtype, kernels=kernels, max_batch_size=1,
              speculative={"model": str(draft), "num_speculative_tokens": spec.k}, **kw)
    context = llm.max_seq_len
    if spec.prompt_len + spec.new_tokens > context:
        raise ValueError(f"prompt_len {spec.prompt_len} + new_tokens {spec.new_tokens} do not fit the "
                         f"target's context of {context} tokens")
    drafter = llm.engine.speculative.drafter
    windows = prompt_windows(llm, Path(text), spec.prompts, spec.prompt_len)

    def alone(prompt, n=spec.new_tokens):
        return decode_run(llm, [prompt], n)

    def with_draft(prompt, n=spec.new_tokens):
        return decode_run(llm, [prompt], n, SpeculativeDecoder(drafter, spec.k))

    with torch.inference_mode():
        warm = min(spec.new_tokens, 8)      # native plans built, caches touched: untimed
        alone(windows[0], warm)
        with_draft(windows[0], warm)
        plain_rates, spec_rates, ratios = [], [], []
        counters = dict.fromkeys(COUNTERS, 0)
        hist = [0] * (spec.k + 1)
        identical = True
        for _ in range(spec.rounds):
            a_tokens = a_seconds = b_tokens = b_seconds = 0.0
            for prompt in windows:
                a = alone(prompt)
                b = with_draft(prompt)
                identical &= a.token_ids == b.token_ids
                a_tokens += a.decode_tokens
                a_seconds += a.seconds
                b_tokens += b.decode_tokens
                b_seconds += b.seconds
                for key in COUNTERS:
                    counters[key] += b.spec.get(key, 0)
                hist = [h + m for h, m in zip(hist, b.spec.get("spec_accepted_hist", []))]
            plain = a_tokens / a_seconds if a_seconds > 0 else float("nan")
            fast = b_tokens / b_seconds if b_seconds > 0 else float("nan")
            plain_rates.append(plain)
            spec_rates.append(fast)
            ratios.append(fast / plain if plain > 0 else float("nan"))
    accepted, rejections = counters["spec_accepted_tokens"], counters["spec_rejections"]
    return {
        "target": "base", "draft": str(draft), "k": spec.k, "prompts": len(windows),
        "prompt_len": spec.prompt_len, "new_tokens": spec.new_tokens, "rounds": spec.rounds,
        "alpha": accepted / (accepted + rejections) if accepted + rejections else None,
        "tokens_per_pass": (counters["spec_emitted_tokens"] / counters["spec_rows"]
                            if counters["spec_rows"] else None),
        "target_tok_s": statistics.median(plain_rates), "spec_tok_s": statistics.median(spec_rates),
        "speedup": statistics.median(ratios), "identical": identical,
        "accepted_hist": hist, **counters,
        "target_tok_s_rounds": plain_rates, "spec_tok_s_rounds": spec_rates,
        "threads": torch.get_num_threads(),
    }


def evaluate_drafts(records: list[dict], spec: SpeculativeEvalConfig, text: str | Path,
                    dtype: str = "float32", kernels: str = "native", w4_activations: str | None = None,
                    log_fn=print) -> None:
    """Measure each draft of ``spec`` against ``records[0]`` (the base) and store the
    figures in the draft's record (``rec["speculative"]``); a failure, or outputs that
    differ from the target's, is recorded in ``rec["errors"]["speculative"]``."""
    from evals.evaluate import _Cells

    base = records[0]
    by_name = {r.get("name"): r for r in records}
    for name in spec.drafts:
        rec = by_name.get(name)
        if rec is None:
            log_fn(f"[eval] speculative: no record of stage {name!r}; skipped")
            continue
        log_fn(f"[eval] speculative: {name} as a draft of {base.get('name', 'base')} (k = {spec.k})")
        cells = _Cells(rec)
        result = cells.run(CELL, measure_draft, base["path"], rec["path"], spec, text,
                           dtype=dtype, kernels=kernels, w4_activations=w4_activations)
        if result is not None:
            rec[CELL] = result
            if not result["identical"]:
                message = (f"greedy outputs with the draft differ from the target's alone (the speculative "
                           f"step must be lossless; alpha {result['alpha']}, k {spec.k})")
                cells.errors[CELL] = {"message": message, "traceback": ""}
                log.warning("%s: %s", name, message)
        if not rec["errors"]:
            del rec["errors"]
