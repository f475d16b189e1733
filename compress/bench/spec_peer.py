"""The peer of ``compress bench spec``: transformers' assisted generation
(``generate(..., assistant_model=draft)``, batch 1 only in transformers) against plain
greedy ``generate`` of the same HF-format target, alternating, with a fixed number of
assistant tokens per round (``num_assistant_tokens_schedule="constant"``) so k means
what it means in our engine. Its figures include the prompt's prefill (transformers
gives no separate decode time); the ratio is what compares."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch


def load_hf(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def _generate(model, prompt: list[int], new_tokens: int, assistant=None) -> tuple[list[int], float]:
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=model.config.eos_token_id)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, **kwargs)
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - t


def assisted_peer(target_dir: Path, assistant_dir: Path, prompts: list[list[int]], new_tokens: int,
                  ks: list[int], repeats: int, log=print) -> list[dict]:
    """One record per k: plain and assisted tok/s (medians over ``repeats`` rounds of every
    prompt, alternating plain / assisted), the median of the rounds' ratios, and whether
    the assisted outputs equal the plain ones."""
    target = load_hf(target_dir)
    assistant = load_hf(assistant_dir)
    records = []
    for k in ks:
        gc = assistant.generation_config
        gc.num_assistant_tokens = k
        gc.num_assistant_tokens_schedule = "constant"
        gc.assistant_confidence_threshold = 0.0     # propose all k (no early stop on low confidence)
        _generate(target, prompts[0], 4)
        _generate(target, prompts[0], 4, assistant)
        plain_rounds, assisted_rounds, ratios = [], [], []
        identical = True
        for _ in range(repeats):
            tp = ta = 0.0
            for prompt in prompts:
                ref, s = _generate(target, prompt, new_tokens)
                tp += s
                got, s = _generate(target, prompt, new_tokens, assistant)
                ta += s
                identical &= got == ref
            n = new_tokens * len(prompts)
            plain_rounds.append(n / tp)
            assisted_rounds.append(n / ta)
            ratios.append(tp / ta)
        rec = {"assistant": str(assistant_dir), "k": k, "batch": 1, "plain_tok_s": statistics.median(plain_rounds),
               "assisted_tok_s": statistics.median(assisted_rounds), "speedup": statistics.median(ratios),
               "identical": identical, "plain_rounds": plain_rounds, "assisted_rounds": assisted_rounds}
        log(f"# transformers assisted k={k}: {rec['assisted_tok_s']:.1f} tok/s vs plain {rec['plain_tok_s']:.1f} "
            f"= {rec['speedup']:.2f}x, identical={identical}")
        records.append(rec)
    return records
