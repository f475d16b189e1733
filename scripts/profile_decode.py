#!/usr/bin/env python
"""Where a decode step's time goes: runs greedy decoding of a checkpoint on our runtime
under torch.profiler and prints time per generated token by op, grouped.

    python scripts/profile_decode.py /tmp/bench-llama/rtn-int4 --threads 2 --tokens 32

Groups: the packed GEMMs (our kernels, lm_head included when it is packed), dense
matmuls, attention, norms, and everything else (views, copies, elementwise ops, the
sampler): the last group is the per-token cost of running the model from Python.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

GROUPS = [
    ("int4 GEMM (compress::w4a16_*)", ("compress::w4a16",)),
    ("int8 GEMM (compress::w8a8_*)", ("compress::w8a8",)),
    ("dense matmul (aten::mm/addmm/linear)", ("aten::mm", "aten::addmm")),
    ("attention", ("compress::decode_attention", "aten::_scaled_dot_product", "aten::scaled_dot_product")),
    ("norms (compress::rms_norm, add_rms_norm)", ("compress::rms_norm", "compress::add_rms_norm")),
]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", help="a compress checkpoint")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32, help="tokens generated in the profiled run")
    p.add_argument("--prompt-len", type=int, default=32)
    args = p.parse_args(argv)

    from compress.runtime import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.path, threads=args.threads)
    prompt = [(7 * i) % (llm.config.vocab_size - 10) + 5 for i in range(args.prompt_len)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = llm.generate([prompt], params)[0]
    m = out.metrics
    steps = m["decode_steps"]
    print(f"decode: {steps} steps in {m['decode_s'] * 1e3:.1f} ms = {m['decode_s'] / steps * 1e3:.2f} ms/token "
          f"({steps / m['decode_s']:.1f} tok/s) under the profiler; prefill {m['prefill_s'] * 1e3:.1f} ms")
    # self time of every op; top-level python ops only count their own (self) time
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for evt in prof.key_averages():
        group = next((g for g, prefixes in GROUPS if evt.key.startswith(prefixes)), "other ops (views, copies, elementwise, sampling)")
        totals[group] += evt.self_cpu_time_total
        calls[group] += evt.count
    whole = sum(totals.values())
    n_tokens = steps + 1  # the profiled run also holds the prefill
    print(f"{'group':<52} {'ms/token':>9} {'share':>7} {'calls/token':>12}")
    for g, _ in GROUPS + [("other ops (views, copies, elementwise, sampling)", ())]:
        print(f"{g:<52} {totals[g] / 1e3 / n_tokens:>9.2f} {100 * totals[g] / whole:>6.1f}% {calls[g] / n_tokens:>12.0f}")
    print(f"{'all ops':<52} {whole / 1e3 / n_tokens:>9.2f} {100.0:>6.1f}%")


if __name__ == "__main__":
    main()
