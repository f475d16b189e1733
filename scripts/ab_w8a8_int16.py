#!/usr/bin/env python
"""The W8A8 int16 GEMM (csrc/cpu/w8a8_i16_avx2.inc) against the byte tiles it replaces
at many rows, measured in one process (AVX2 CPUs without VNNI; elsewhere both settings
run the same kernel).

    python scripts/ab_w8a8_int16.py --threads 2 --m 16 32 64 128 256 --rounds 5
    python scripts/ab_w8a8_int16.py --threads 2 --model /tmp/bench-llama2/rtn-int8 --prompt-tokens 64 256

For every M and shape, each round calls `w8a8_gemm_prepared` (fp32 x, row-tiled weights,
warm caches) with the int16 GEMM on and off (compress.ops.set_w8a8_int16_min_rows)
and fp32 `matmul`, alternating, so the machine's drift hits all three alike. Prints the
median GMAC/s of each, the int16 / byte-tile ratio and both against fp32, and checks
that the two int8 paths gave the same bits. With --model, the same for the prefill of a
packed int8 checkpoint (one sequence per prompt length, the runtime's ModelRunner; its
W8A8 linears run at M = the prompt length): prefill tokens/s with the int16 GEMM on and
off, and whether the logits are the same bits.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compress import ops  # noqa: E402
from compress.ops.reference import w8a8_tile_cpu  # noqa: E402

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (2048, 8192)]
NEVER = 1 << 62  # a row threshold no call reaches: the byte tiles


def model_ab(path: str, prompt_lengths: list[int], rounds: int, default: int) -> bool:
    """Prefill A/B on a checkpoint; False if the two paths' logits differ."""
    from compress.runtime.loading import open_checkpoint
    from compress.runtime.model_runner import ModelRunner
    from compress.runtime.models.llama import build_model

    model = build_model(open_checkpoint(path))
    for length in prompt_lengths:
        prompt = [(7 * i) % (model.vocab_size - 5) + 5 for i in range(length)]
        times: dict[str, list[float]] = {"int16": [], "bytes": []}
        logits = {}
        for _ in range(rounds + 1):  # the first round warms up, untimed
            for name, rows in (("int16", default), ("bytes", NEVER)):
                ops.set_w8a8_int16_min_rows(rows)
                runner = ModelRunner(model)
                t0 = time.perf_counter()
                logits[name] = runner.prefill([prompt], length + 1)
                times[name].append(time.perf_counter() - t0)
        same = torch.equal(logits["int16"], logits["bytes"])
        rate = {name: length / statistics.median(t[1:]) for name, t in times.items()}
        print(f"prefill {length:5d} tokens: int16 {rate['int16']:7.1f}  bytes {rate['bytes']:7.1f} tok/s   "
              f"int16/bytes {rate['int16'] / rate['bytes']:.2f}{'' if same else '   LOGITS DIFFER'}", flush=True)
        if not same:
            return False
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--m", type=int, nargs="+", default=[16, 64, 256], help="rows M")
    p.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="NxK (out x in)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", help="a packed int8 checkpoint: time its prefill instead of single GEMMs")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 256], help="prompt lengths (--model)")
    args = p.parse_args(argv)
    if not ops.native_available("cpu"):
        print("compress._C is not built: nothing to measure", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    default = ops.set_w8a8_int16_min_rows(NEVER)
    ops.set_w8a8_int16_min_rows(default)
    print(f"# isa={ops.cpu_isa()} threads={torch.get_num_threads()} int16 GEMM from M={default}; "
          f"medians of {args.rounds} alternating rounds, warm caches")
    gemm = torch.ops.compress.w8a8_gemm_prepared
    try:
        if args.model:
            return 0 if model_ab(args.model, args.prompt_tokens, args.rounds, default) else 1
        for m in args.m:
            for shape in args.shapes:
                n, k = (int(v) for v in shape.lower().split("x"))
                g = torch.Generator().manual_seed(0)
                q = w8a8_tile_cpu(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8))
                s = torch.rand(n, generator=g) * 0.01 + 1e-3
                x = torch.randn(m, k, generator=g)
                wf = torch.randn(n, k, generator=g)
                runs = {"int16": (1, lambda: gemm(x, q, s)), "bytes": (NEVER, lambda: gemm(x, q, s)),
                        "fp32": (default, lambda: x @ wf.t())}
                times: dict[str, list[float]] = {name: [] for name in runs}
                outs = {}
                for _ in range(args.rounds + 1):  # the first round warms up, untimed
                    for name, (rows, fn) in runs.items():
                        ops.set_w8a8_int16_min_rows(rows)
                        t0 = time.perf_counter()
                        outs[name] = fn()
                        times[name].append(time.perf_counter() - t0)
                same = torch.equal(outs["int16"], outs["bytes"])
                rate = {name: m * n * k / statistics.median(t[1:]) / 1e9 for name, t in times.items()}
                print(f"M={m:4d} {n:6d}x{k:<6d} int16 {rate['int16']:6.1f}  bytes {rate['bytes']:6.1f}  "
                      f"fp32 {rate['fp32']:6.1f} GMAC/s   int16/bytes {rate['int16'] / rate['bytes']:.2f}  "
                      f"int16/fp32 {rate['int16'] / rate['fp32']:.2f}  bytes/fp32 {rate['bytes'] / rate['fp32']:.2f}"
                      f"{'' if same else '   OUTPUTS DIFFER'}", flush=True)
                if not same:
                    return 1
    finally:
        ops.set_w8a8_int16_min_rows(default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
