#!/usr/bin/env python
"""Paged attention alone (``compress::paged_decode_attention``), cycled over ``--layers``
layers' K / V pools in 2 MiB pages so that they come from DRAM (one layer: from cache).

    python csrc/cpu/lab/ab_paged_attention.py decode --rows 16 --keys 250 --kv-dtype float16
    python csrc/cpu/lab/ab_paged_attention.py chunk --keys 1750 --rows 2 4 6 8 --kv-dtype float16 float32

``decode``: ``--rows`` rows attending alone, ``--keys`` positions each (the row kernel).
``chunk``: one prompt chunk of n rows sharing their keys at ``--keys`` positions, timed
as one call (the chunk kernel) and as n one-row calls (the decode rows' kernel, each row
alone) in the same process, outputs compared bitwise. Heads: 16 q / 8 kv of 64 (the 345M
bench model). Prints the median microseconds a layer.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import compress.ops  # noqa: F401  (registers the ops, loads compress._C)
from compress.ops import kv_int8
from compress.runtime.hugepages import huge_page_zeros

HQ, HKV, D, BS = 16, 8, 64, 16


def pools(layers, blocks, dtype):
    out = []
    for i in range(layers):
        pair = []
        for j in range(2):
            shape = (blocks, HKV, BS, kv_int8.row_elems(D, dtype))
            t = huge_page_zeros(shape, dtype)
            t = torch.zeros(shape, dtype=dtype) if t is None else t
            x = torch.randn((blocks, HKV, BS, D), generator=torch.Generator().manual_seed(2 * i + j))
            t.copy_(kv_int8.to_pool(x, dtype))
            pair.append(t)
        out.append(pair)
    return out


def timed_per_layer_us(kv, attend, reps):
    """Median microseconds a layer of ``attend(k, v)`` cycled over the layers' pools, and
    the first layer's output."""
    outs = []

    def one():
        outs.clear()
        for k, v in kv:
            outs.append(attend(k, v))
    one(), one()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(kv) * 1e6, outs[0]


def per_layer_us(kv, q, tables, lens, reps):
    """The rows in one call."""
    op = torch.ops.compress.paged_decode_attention
    return timed_per_layer_us(kv, lambda k, v: op(q, k, v, tables, lens, 0), reps)


def per_layer_us_rows(kv, q, tables, lens, reps):
    """Each row its own call (each attends alone)."""
    op = torch.ops.compress.paged_decode_attention
    return timed_per_layer_us(kv, lambda k, v: torch.cat([op(q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1], 0)
                                                          for i in range(q.shape[0])]), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["decode", "chunk"])
    ap.add_argument("--rows", type=int, nargs="+", default=[16])
    ap.add_argument("--keys", type=int, default=250)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--kv-dtype", nargs="+", default=["float16"], choices=["float16", "bfloat16", "float32", "int8"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    per_row = -(-(args.keys + max(args.rows)) // BS)
    for name in args.kv_dtype:
        dtype = getattr(torch, name)
        for n in args.rows:
            blocks = per_row * (n if args.mode == "decode" else 1) + 8
            kv = pools(args.layers, blocks, dtype)
            order = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).int()
            q = torch.randn(n, HQ, D, generator=torch.Generator().manual_seed(1))
            if args.mode == "decode":
                tables = order[:n * per_row].view(n, per_row).contiguous()
                lens = torch.full((n,), args.keys, dtype=torch.int32)
                us, _ = per_layer_us(kv, q, tables, lens, args.reps)
                print(f"{name:8s} decode {n} rows x {args.keys} keys, {args.layers} layers: {us:.1f} us a layer")
                continue
            tables = order[:per_row].expand(n, per_row).contiguous()
            lens = torch.arange(args.keys + 1, args.keys + n + 1, dtype=torch.int32)
            group, g_out = per_layer_us(kv, q, tables, lens, args.reps)
            rows, r_out = per_layer_us_rows(kv, q, tables, lens, args.reps)
            print(f"{name:8s} chunk of {n} rows at {args.keys} keys, {args.layers} layers: rows alone {rows:.1f} "
                  f"us a layer, chunk kernel {group:.1f} ({group / rows:.2f}x); same bits: {torch.equal(g_out, r_out)}")


if __name__ == "__main__":
    main()
