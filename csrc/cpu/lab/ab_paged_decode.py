"""Decode-step time of the native plan on a checkpoint, in whichever tree this runs from:
the paged plan (``compress.runtime.native_decode``: pools and shuffled block tables) or,
in a tree from before it, the dense-cache plan (``model.decode_plan``: one
``[layers, rows, kv heads, slots, head_dim]`` cache, one shared slot). Run it once per
tree, in separate processes, alternating, with the machine to itself:

    PYTHONPATH=OLD_TREE python csrc/cpu/lab/ab_paged_decode.py CKPT --batch 1 16
    PYTHONPATH=NEW_TREE python csrc/cpu/lab/ab_paged_decode.py CKPT --batch 1 16

Every row holds ``--context`` tokens when timing starts and gains one per step (the same
position in every row, so both plans do the same work). Prints, per batch, the median step
time, tokens/s (rows / step), and the attention op alone over every layer's cache at the
middle step's length (standalone, so its caches are warmer than inside a step where the
weights have just streamed through them: a lower bound on its share).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from compress.runtime.hugepages import huge_page_zeros
from compress.runtime.loading import open_checkpoint
from compress.runtime.models.llama import build_model

try:
    from compress.runtime.native_decode import build_native_decode
except ImportError:  # a tree from before the paged plan
    build_native_decode = None


def zeros(shape, dtype):
    t = huge_page_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype) if t is None else t


def filled(shape, dtype, seed):
    t = zeros(shape, dtype)
    t.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
    return t


class Paged:
    """The paged plan: each row's blocks drawn from a shuffled pool."""
    name = "paged"

    def __init__(self, model, batch, max_len, kv_dtype, block_size):
        self.native = build_native_decode(model)
        assert self.native is not None, "the model has no native decode plan"
        per_row = -(-max_len // block_size)
        nb = batch * per_row
        shape = (len(model.layers), nb, model.n_kv_heads, block_size, model.head_dim)
        self.k, self.v = filled(shape, kv_dtype, 1), filled(shape, kv_dtype, 2)
        order = list(range(nb))
        random.Random(0).shuffle(order)
        self.tables = torch.tensor(order, dtype=torch.int32).view(batch, per_row)

    def step(self, ids, pos):
        return self.native.decode(ids, [pos] * len(ids), self.k, self.v, self.tables, greedy=True)

    def attention(self, q, length):
        lens = torch.full((q.shape[0],), length, dtype=torch.int32)
        op = torch.ops.compress.paged_decode_attention.default
        for i in range(self.k.shape[0]):
            op(q, self.k[i], self.v[i], self.tables, lens, 0)


class Dense:
    """The dense-cache plan of the trees before the paged one."""
    name = "dense"

    def __init__(self, model, batch, max_len, kv_dtype, block_size):
        self.plan = model.decode_plan
        assert self.plan is not None, "the model has no decode plan"
        shape = (len(model.layers), batch, model.n_kv_heads, max_len, model.head_dim)
        self.k, self.v = filled(shape, kv_dtype, 1), filled(shape, kv_dtype, 2)
        self.masks = [None] * len(model.decode_windows)

    def step(self, ids, pos):
        return self.plan.decode_tokens(ids, [pos] * len(ids), self.k, self.v, pos, self.masks, True)

    def attention(self, q, length):
        op = torch.ops.compress.decode_attention.default
        b = q.shape[0]
        for i in range(self.k.shape[0]):
            op(q, self.k[i][:b, :, :length], self.v[i][:b, :, :length], None)


def measure(model, batch, args, kv_dtype):
    impl = (Paged if build_native_decode is not None else Dense)(model, batch, args.context + args.steps + 4,
                                                                    kv_dtype, args.block_size)
    ids = [(17 * r + 5) % model.vocab_size for r in range(batch)]
    for i in range(3):  # warm-up at the first positions (their keys are overwritten later anyway)
        impl.step(ids, args.context + i)
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        impl.step(ids, args.context + i)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    q = torch.randn(batch, model.layers[0].attn.n_heads, model.head_dim).to(model.dtype)
    length = args.context + args.steps // 2
    attn = []
    for _ in range(5):
        t0 = time.perf_counter()
        impl.attention(q, length)
        attn.append(time.perf_counter() - t0)
    return {"plan": impl.name, "batch": batch, "context": args.context, "step_ms": step * 1e3,
            "tok_s": batch / step, "attention_ms": statistics.median(attn) * 1e3,
            "attention_share": statistics.median(attn) / step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=64, help="tokens in every row when timing starts")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", default="model", choices=["model", "float16", "bfloat16", "float32"])
    ap.add_argument("--json", help="append one JSON line per batch to this file")
    ap.add_argument("--w4-activations", default="float", choices=["float", "int8"], help="int4 layers' activations")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(open_checkpoint(args.checkpoint), w4_activations=args.w4_activations)
    kv_dtype = model.dtype if args.kv_dtype == "model" else getattr(torch, args.kv_dtype)
    with torch.inference_mode():
        for batch in args.batch:
            rec = measure(model, batch, args, kv_dtype)
            rec.update(kv_dtype=str(kv_dtype).removeprefix("torch."), threads=args.threads)
            print(f"{rec['plan']:<6} batch {batch:>3}  context {args.context}  step {rec['step_ms']:.2f} ms  "
                  f"{rec['tok_s']:.1f} tok/s  attention alone {rec['attention_ms']:.3f} ms "
                  f"({100 * rec['attention_share']:.1f}% of a step)", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
