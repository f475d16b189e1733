#!/usr/bin/env python
"""The CUDA paged decode attention kernels (``compress::paged_decode_attention``) per K / V
element type, against each other and the bandwidth roofline.

    python csrc/cuda/lab/paged_attention_kv.py --rows 1 16 64 --keys 512 2048 --kv-dtype float16 int8

Heads: 32 q / 4 kv of 64, blocks of 16 (TinyLlama's attention). Each case cycles through
copies of its pools (at least ``--rotate-mb`` of them, up to 1,024 copies) so K and V
come from HBM, not the 50 MB L2, and times a CUDA graph of one call per copy (at least
``--inner``) for each kernel (``--kernels``: the split kernel, the default, and the heads
kernel, the baseline) in the same process (medians of ``--reps`` interleaved rounds,
``compress.bench.cuda.time_fns``). "GB/s" counts each row's K and V bytes once; "% roof"
is that traffic at the device copy bandwidth measured in the same run over the time
taken; "x base" is the time over the last kernel's on the same pools.
"""
from __future__ import annotations

import argparse
import itertools

import torch

import compress.ops as ops  # registers the ops, loads compress._cuda
from compress.bench.cuda import measure_copy_bandwidth, time_fns
from compress.dtypes import KV_CACHE_DTYPES
from compress.ops import kv_int8

HQ, HKV, D, BS = 32, 4, 64, 16
MAX_INNER = 1024


def case(rows: int, keys: int, kv_dtype: torch.dtype, copies: int, seed: int = 0):
    """``copies`` sets of (q, k_pool, v_pool, tables, lens): each row ``keys`` positions in
    its own shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    per_row = -(-keys // BS)
    nb = rows * per_row
    sets = []
    for _ in range(copies):
        tables = torch.randperm(nb, generator=g).to(torch.int32).view(rows, per_row)
        k, v = (kv_int8.to_pool(torch.randn(nb, HKV, BS, D, generator=g), kv_dtype).cuda() for _ in range(2))
        q = torch.randn(rows, HQ, D, generator=g).half().cuda()
        sets.append((q, k, v, tables.cuda(), torch.full((rows,), keys, dtype=torch.int32).cuda()))
    return sets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--keys", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--kv-dtype", nargs="+", default=["float16", "int8"], choices=list(KV_CACHE_DTYPES))
    ap.add_argument("--kernels", nargs="+", default=["split", "heads"], choices=["split", "heads"])
    ap.add_argument("--rotate-mb", type=float, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--inner", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("paged_attention_kv: no CUDA device; nothing measured")
        return 1
    bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device copy {bw / 1e12:.2f} TB/s (read + written)")
    print(f"{'rows':>5} {'keys':>6} {'kv':>9} {'kernel':>7} {'us':>8} {'GB/s':>7} {'% roof':>7} {'x base':>7}")
    before = ops.set_cuda_paged_attention_kernel(args.kernels[0])
    try:
        for rows, keys in itertools.product(args.rows, args.keys):
            traffic = {name: 2 * rows * HKV * keys * kv_int8.row_elems(D, KV_CACHE_DTYPES[name])
                       * KV_CACHE_DTYPES[name].itemsize for name in args.kv_dtype}
            copies = {name: int(args.rotate_mb * 2**20 // n) + 1 for name, n in traffic.items()}
            inner = min(MAX_INNER, max(args.inner, *copies.values()))  # a graph's calls walk every copy
            fns = {}
            for name in args.kv_dtype:
                sets = case(rows, keys, KV_CACHE_DTYPES[name], min(copies[name], inner))
                for kernel in args.kernels:
                    def call(cycle=itertools.cycle(sets), kernel=kernel):
                        ops.set_cuda_paged_attention_kernel(kernel)  # at capture: the graph keeps its kernel
                        return torch.ops.compress.paged_decode_attention(*next(cycle), 0)
                    fns[name, kernel] = call
            ms = time_fns(fns, args.reps, inner, graphs=True)
            for (name, kernel), t in ms.items():
                gbs = traffic[name] / (t * 1e-3) / 1e9
                roof = traffic[name] / bw / (t * 1e-3)
                base = ms[name, args.kernels[-1]]
                print(f"{rows:>5} {keys:>6} {name:>9} {kernel:>7} {t * 1e3:>8.1f} {gbs:>7.0f} {100 * roof:>6.0f}% "
                      f"{t / base:>6.2f}x")
    finally:
        ops.set_cuda_paged_attention_kernel(before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
