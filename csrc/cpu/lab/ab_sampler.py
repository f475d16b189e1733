#!/usr/bin/env python
"""The runtime's sampler (compress/runtime/sampling.py: nucleus candidates from topk,
one uniform per row, the inverse of the cumulative distribution) against the form it
replaced (a sort of every row for top-k / top-p, then an exponential race: one Exp(1)
draw per token), alternating in one process on synthetic logits.

    python csrc/cpu/lab/ab_sampler.py --threads 2 --vocab 4096 32000 152064 --rows 1 16

Logits are N(0, scale^2) per token: scale 1 is a flat row (a top_p 0.95 nucleus of most
of the vocabulary, the candidates' worst case), scale 4 a peaked one. Prints the median
microseconds of a call of each form and their ratio, per vocabulary, rows, scale and top_p
(temperature 0.8; top_p 1 is temperature alone)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, when not installed

from compress.bench.timing import median_seconds  # noqa: E402
from compress.runtime.sampling import filter_logits, sample  # noqa: E402


def sample_sorted_race(logits, temperature, top_k, top_p, generators, need_filter=True):
    """The replaced form: filter_logits' sort, softmax, one Exp(1) per token, argmax of p / E."""
    scaled = logits / temperature.unsqueeze(1)
    if need_filter:
        scaled = filter_logits(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, g in enumerate(generators):
        noise[i].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--vocab", type=int, nargs="+", default=[4096, 32000, 152064])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--scales", type=float, nargs="+", default=[1.0, 4.0])
    p.add_argument("--top-p", type=float, nargs="+", default=[0.95, 1.0])
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# threads={torch.get_num_threads()}; median us of {args.reps} calls, the two forms alternating per case")
    g = torch.Generator().manual_seed(0)
    for vocab in args.vocab:
        for rows in args.rows:
            for scale in args.scales:
                logits = torch.randn(rows, vocab, generator=g) * scale
                gens = [torch.Generator().manual_seed(i) for i in range(rows)]
                temp, top_k = torch.full((rows,), 0.8), torch.zeros(rows, dtype=torch.long)
                for top_p in args.top_p:
                    tp = torch.full((rows,), top_p)
                    filt = top_p < 1.0
                    new = 1e6 * median_seconds(lambda: sample(logits, temp, top_k, tp, gens, need_filter=filt), args.reps, 1)
                    old = 1e6 * median_seconds(lambda: sample_sorted_race(logits, temp, top_k, tp, gens, filt), args.reps, 1)
                    print(f"vocab {vocab:6d} rows {rows:2d} scale {scale:3.1f} top_p {top_p:4.2f}: sort + race {old:8.0f} us"
                          f"  sampler {new:8.0f} us  {old / new:5.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
