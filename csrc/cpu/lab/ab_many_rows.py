#!/usr/bin/env python
"""A many-row kernel path against the tiles it replaces, in one process (the machinery
and what each path is: compress/bench/many_rows.py).

    python csrc/cpu/lab/ab_many_rows.py --threads 2 --m 16 32 64 128 256 --rounds 5
    python csrc/cpu/lab/ab_many_rows.py --path amx --threads 2 --m 8 16 32 64 256
    python csrc/cpu/lab/ab_many_rows.py --path w4-amx --threads 2 --m 16 24 32 64 256
    python csrc/cpu/lab/ab_many_rows.py --threads 2 --model /tmp/bench-llama2/rtn-int8 --prompt-tokens 64 256
    python csrc/cpu/lab/ab_many_rows.py --path w4-amx --threads 2 --model out/bench-llama/rtn-int4 --decode-rows 16 24

Prints, per M and shape, the median GMAC/s of the path on, off and fp32 matmul, their
ratios and the outputs' comparison; with --model, prefill tokens/s of a packed
checkpoint (int8 for the W8A8 paths, int4 for w4-amx) per prompt length, logits
compared, or with --decode-rows its decode tokens/s at those batch sizes instead
(prompts of the first --prompt-tokens length, 32 decode steps), greedy tokens compared.
Exit status 1 when the two sides disagree (for a decode: when an exact path's tokens do).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, when not installed

from compress import ops  # noqa: E402
from compress.bench import many_rows  # noqa: E402

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (2048, 8192)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", choices=sorted(many_rows.PATHS), default=None,
                   help="which many-row path to time (default: amx where the CPU has it, else int16)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--m", type=int, nargs="+", default=[16, 64, 256], help="rows M")
    p.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="NxK (out x in)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", help="a packed checkpoint (int8 for int16 / amx, int4 for w4-amx): time its "
                   "prefill instead of single GEMMs")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 256], help="prompt lengths (--model)")
    p.add_argument("--decode-rows", type=int, nargs="+", default=None,
                   help="--model: time decode steps of this many rows (prompts of the first --prompt-tokens "
                   "length, default 128) instead of prefill")
    args = p.parse_args(argv)
    if args.decode_rows is not None and not args.model:
        p.error("--decode-rows needs --model")
    if args.decode_rows is not None and min(args.decode_rows) < 1:
        p.error("--decode-rows: rows must be >= 1")
    if not ops.native_available("cpu"):
        print("compress._C is not built: nothing to measure", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.path or many_rows.default_path()
    which = many_rows.PATHS[path]
    print(f"# isa={ops.cpu_isa()} threads={torch.get_num_threads()} {which.what} from M={which.get_rows()}"
          f"{'' if many_rows.usable(path) else ' (not taken on this CPU: both sides run the same tiles)'}; "
          f"medians of {args.rounds} alternating rounds, warm caches")
    if args.model and args.decode_rows:
        prompt_len = args.prompt_tokens[0] if "--prompt-tokens" in (argv if argv is not None else sys.argv) else 128
        ok = True
        for rows in args.decode_rows:
            try:
                (r,) = many_rows.decode_ab(args.model, path, [rows], args.rounds, prompt_len=prompt_len)
            except ValueError as e:
                print(e, file=sys.stderr)
                return 1
            print(many_rows.format_decode_ab(path, r), flush=True)
            ok = ok and (r.same_tokens == 1.0 or not which.exact)
        return 0 if ok else 1
    if args.model:
        try:
            results = many_rows.prefill_ab(args.model, path, args.prompt_tokens, args.rounds)
        except ValueError as e:
            print(e, file=sys.stderr)
            return 1
        for r in results:
            print(many_rows.format_prefill_ab(path, r), flush=True)
        return 0 if all(r.comparison.ok for r in results) else 1
    for m in args.m:
        for shape in args.shapes:
            n, k = (int(v) for v in shape.lower().split("x"))
            r = many_rows.gemm_ab(path, m, n, k, args.rounds)
            print(many_rows.format_gemm_ab(path, r), flush=True)
            if not r.comparison.ok:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
