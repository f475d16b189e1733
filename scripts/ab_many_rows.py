#!/usr/bin/env python
"""A many-row kernel path against the tiles it replaces, measured in one process:
`--path int16`, the W8A8 int16 GEMM (csrc/cpu/w8a8_i16_avx2.inc) against the byte tiles
(AVX2 CPUs without VNNI); `--path amx`, the W8A8 AMX-INT8 tiles (csrc/cpu/w8a8_amx.inc)
against the VNNI tiles; `--path w4-amx`, the W4A16 AMX-BF16 tiles
(csrc/cpu/w4a16_amx.inc) against the int8 tiles (CPUs with AMX). Elsewhere both
settings run the same kernel.

    python scripts/ab_many_rows.py --threads 2 --m 16 32 64 128 256 --rounds 5
    python scripts/ab_many_rows.py --path amx --threads 2 --m 8 16 32 64 256
    python scripts/ab_many_rows.py --path w4-amx --threads 2 --m 16 24 32 64 256
    python scripts/ab_many_rows.py --threads 2 --model /tmp/bench-llama2/rtn-int8 --prompt-tokens 64 256

For every M and shape, each round calls the prepared op (`w8a8_gemm_prepared`, or
`w4a16_gemm_prepared` with groups of 128; fp32 x, row-tiled weights, warm caches) with
the path on and off (its row threshold: compress.ops.set_w8a8_int16_min_rows /
set_w8a8_amx_min_rows / set_w4a16_amx_min_rows) and fp32 `matmul`, alternating, so the
machine's drift hits all three alike. Prints the median GMAC/s of each, the on / off
ratio and both against fp32, and checks the outputs: the W8A8 paths must give the same
bits; the W4A16 AMX path rounds differently (bf16), so the SQNR between the two is
printed and must stay above 40 dB. With --model, the same for the prefill of a packed
checkpoint (int8 for the W8A8 paths, int4 for w4-amx; one sequence per prompt length,
the runtime's ModelRunner, whose linears run at M = the prompt length): prefill tokens/s
with the path on and off, and the logits compared the same way.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compress import ops  # noqa: E402
from compress.ops.reference import pack_int4, w4a16_prepare_cpu, w8a8_tile_cpu  # noqa: E402
from quantizers.primitives import sqnr_db  # noqa: E402

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (2048, 8192)]
NEVER = 1 << 62  # a row threshold no call reaches: the path is off


class ManyRowPath(NamedTuple):
    set_rows: Callable[[int], int]  # its row threshold's setter (returns the previous value)
    get_rows: Callable[[], int]
    on: str  # labels of the two sides
    off: str
    what: str
    exact: bool  # whether both sides must give the same bits


PATHS = {
    "int16": ManyRowPath(ops.set_w8a8_int16_min_rows, ops.w8a8_int16_min_rows, "int16", "bytes", "int16 GEMM", True),
    "amx": ManyRowPath(ops.set_w8a8_amx_min_rows, ops.w8a8_amx_min_rows, "amx", "vnni", "AMX tiles", True),
    "w4-amx": ManyRowPath(ops.set_w4a16_amx_min_rows, ops.w4a16_amx_min_rows, "amx", "int8", "W4A16 AMX tiles", False),
}
# Least SQNR between the two sides of an inexact path: one GEMM, and a whole model's
# logits, where the two roundings compound over every layer (the 345M benchmark Llama's
# int4 export read ~32 dB)
MIN_SQNR_DB = {"gemm": 40.0, "logits": 20.0}


def agree(a: torch.Tensor, b: torch.Tensor, exact: bool, what: str = "gemm") -> tuple[bool, str]:
    """Whether the two sides' outputs agree, and what to print about them; for logits of
    an inexact path also how many rows' greedy tokens are the same."""
    if exact:
        same = torch.equal(a, b)
        return same, "" if same else "   OUTPUTS DIFFER"
    db = sqnr_db(b.float(), a.float())
    note = f"   sqnr(on, off) {db:.1f} dB"
    if what == "logits":
        same = (a.argmax(-1) == b.argmax(-1)).reshape(-1)
        note += f", greedy token the same in {int(same.sum())} of {same.numel()}"
    ok = db > MIN_SQNR_DB[what]
    return ok, note + ("" if ok else " TOO LOW")


def usable(path: str) -> bool:
    """Whether this CPU (at the current ISA cap) takes the path at all."""
    isa = ops.cpu_isa()
    return {"int16": isa == "avx2", "amx": isa == "avx512_vnni" and ops.w8a8_amx_available(),
            "w4-amx": isa == "avx512_vnni" and ops.w4a16_amx_available()}[path]


def model_ab(path: str, prompt_lengths: list[int], rounds: int, default: int, which: ManyRowPath) -> bool:
    """Prefill A/B on a checkpoint; False if the two sides' logits disagree."""
    from compress.runtime.loading import open_checkpoint
    from compress.runtime.model_runner import ModelRunner
    from compress.runtime.models.llama import build_model

    model = build_model(open_checkpoint(path))
    set_rows, on, off, exact = which.set_rows, which.on, which.off, which.exact
    for length in prompt_lengths:
        prompt = [(7 * i) % (model.vocab_size - 5) + 5 for i in range(length)]
        times: dict[str, list[float]] = {on: [], off: []}
        logits = {}
        for _ in range(rounds + 1):  # the first round warms up, untimed
            for name, rows in ((on, default), (off, NEVER)):
                set_rows(rows)
                runner = ModelRunner(model)
                t0 = time.perf_counter()
                logits[name] = runner.prefill([prompt], length + 1)
                times[name].append(time.perf_counter() - t0)
        ok, note = agree(logits[on], logits[off], exact, "logits")
        rate = {name: length / statistics.median(t[1:]) for name, t in times.items()}
        print(f"prefill {length:5d} tokens: {on} {rate[on]:7.1f}  {off} {rate[off]:7.1f} tok/s   "
              f"{on}/{off} {rate[on] / rate[off]:.2f}{note.replace('OUTPUTS', 'LOGITS')}", flush=True)
        if not ok:
            return False
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", choices=sorted(PATHS), default=None,
                   help="which many-row path to time (default: amx where the CPU has it, else int16)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--m", type=int, nargs="+", default=[16, 64, 256], help="rows M")
    p.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="NxK (out x in)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", help="a packed checkpoint (int8 for int16 / amx, int4 for w4-amx): time its "
                   "prefill instead of single GEMMs")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 256], help="prompt lengths (--model)")
    args = p.parse_args(argv)
    if not ops.native_available("cpu"):
        print("compress._C is not built: nothing to measure", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.path is None:
        args.path = "amx" if usable("amx") else "int16"
    path = PATHS[args.path]
    set_rows, on, off, what, exact = path.set_rows, path.on, path.off, path.what, path.exact
    default = path.get_rows()
    print(f"# isa={ops.cpu_isa()} threads={torch.get_num_threads()} {what} from M={default}"
          f"{'' if usable(args.path) else ' (not taken on this CPU: both sides run the same tiles)'}; "
          f"medians of {args.rounds} alternating rounds, warm caches")
    try:
        if args.model:
            return 0 if model_ab(args.model, args.prompt_tokens, args.rounds, default, path) else 1
        for m in args.m:
            for shape in args.shapes:
                n, k = (int(v) for v in shape.lower().split("x"))
                g = torch.Generator().manual_seed(0)
                if args.path == "w4-amx":
                    group = 128 if k % 128 == 0 else 32
                    prepared = w4a16_prepare_cpu(
                        pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)),
                        (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half(),
                        torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8))
                    def gemm(xx, p=prepared, gs=group):
                        return torch.ops.compress.w4a16_gemm_prepared(xx, *p, gs)
                else:
                    q = w8a8_tile_cpu(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8))
                    s = torch.rand(n, generator=g) * 0.01 + 1e-3
                    def gemm(xx, q=q, s=s):
                        return torch.ops.compress.w8a8_gemm_prepared(xx, q, s)
                x = torch.randn(m, k, generator=g)
                wf = torch.randn(n, k, generator=g)
                runs = {on: (1, lambda: gemm(x)), off: (NEVER, lambda: gemm(x)),
                        "fp32": (default, lambda: x @ wf.t())}
                times: dict[str, list[float]] = {name: [] for name in runs}
                outs = {}
                for _ in range(args.rounds + 1):  # the first round warms up, untimed
                    for name, (rows, fn) in runs.items():
                        set_rows(rows)
                        t0 = time.perf_counter()
                        outs[name] = fn()
                        times[name].append(time.perf_counter() - t0)
                ok, note = agree(outs[on], outs[off], exact)
                rate = {name: m * n * k / statistics.median(t[1:]) / 1e9 for name, t in times.items()}
                print(f"M={m:4d} {n:6d}x{k:<6d} {on} {rate[on]:6.1f}  {off} {rate[off]:6.1f}  "
                      f"fp32 {rate['fp32']:6.1f} GMAC/s   {on}/{off} {rate[on] / rate[off]:.2f}  "
                      f"{on}/fp32 {rate[on] / rate['fp32']:.2f}  {off}/fp32 {rate[off] / rate['fp32']:.2f}"
                      f"{note}", flush=True)
                if not ok:
                    return 1
    finally:
        set_rows(default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
