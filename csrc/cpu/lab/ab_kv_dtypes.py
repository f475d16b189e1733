#!/usr/bin/env python
"""What a KV cache element type costs in generated text: greedy continuations of
``--prompts`` prompts (``--prompt-len`` tokens each, cut from a text file) with each
``--kv-dtypes`` cache against the exact cache (the model's dtype), on one checkpoint.

    python csrc/cpu/lab/ab_kv_dtypes.py out/quickstart/rtn-int4 --kv-dtypes float16 bfloat16 int8

Prints, per cache type: the share of prompts whose continuation is identical, the median
position of the first differing token, and the mean |logprob difference| of the chosen
tokens over the positions before it (the same tokens on both sides, so the same
prefixes: the logprobs differ only through the cache's rounding).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from compress.runtime import LLM, SamplingParams

DEFAULT_TEXT = Path(__file__).resolve().parents[3] / "data" / "pydoc" / "eval.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--kv-dtypes", nargs="+", default=["float16", "int8"],
                    choices=["float32", "bfloat16", "float16", "int8"])
    ap.add_argument("--text", default=str(DEFAULT_TEXT))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    exact = LLM(args.checkpoint, threads=args.threads)
    ids = exact.tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))
    step = max(1, (len(ids) - args.prompt_len) // args.prompts)
    prompts = [ids[i:i + args.prompt_len] for i in range(0, step * args.prompts, step)][:args.prompts]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    want = exact.generate(prompts, params)
    print(f"{args.checkpoint}: {len(prompts)} prompts of {args.prompt_len} tokens, {args.new_tokens} greedy tokens; "
          f"exact cache {exact.kv_cache_dtype}")
    for name in args.kv_dtypes:
        got = LLM(args.checkpoint, threads=args.threads, kv_cache_dtype=name).generate(prompts, params)
        firsts, drift = [], []
        for a, b in zip(want, got):
            n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
            firsts.append(n)
            drift += [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs[:n], b.logprobs[:n])]
        same = sum(n == args.new_tokens for n in firsts)
        print(f"  kv {name:8s}: identical {same}/{len(firsts)}, first difference at median {statistics.median(firsts)}"
              f" (min {min(firsts)}), mean |logprob diff| before it {statistics.fmean(drift) if drift else 0:.2e}")


if __name__ == "__main__":
    main()
