#!/usr/bin/env python
"""Where a decode step's time goes: runs greedy decoding of a checkpoint on our runtime
under torch.profiler and prints time per generated token by op, grouped.

    python scripts/profile_decode.py /tmp/bench-llama/rtn-int4 --threads 2 --tokens 32

By default a decode step is one ``compress._C.DecodePlan.decode_tokens`` call (the
embedding, every layer as ``compress::decode_layer``'s C++, the final norm, the lm_head
and the greedy argmax), whose GEMMs, norms and attention are direct C++ calls inside it
(one group, recorded as DecodePlan.decode); ``--per-layer-op`` calls the ``compress::decode_layer`` op once per layer
instead, and ``--module-path`` runs the layers op by op (``model.fused_decode = False``)
to split the time by op.

Groups: the packed GEMMs (our kernels, lm_head included when it is packed), dense
matmuls, attention, norms, and everything else (views, copies, elementwise ops, the
sampler). Decode only: a 1-token run (prefill) is profiled too and subtracted. The
time of a step that falls in no op is the interpreter between ops (inflated by the
profiler's own cost).
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

PLAN_EVENT = "compress._C.DecodePlan.step"
DECODE_EVENT = "compress._C.DecodePlan.decode"
GROUPS = [
    ("whole step (DecodePlan.decode)", (DECODE_EVENT,)),
    ("whole layers (DecodePlan.step or compress::decode_layer)", (PLAN_EVENT, "compress::decode_layer")),
    ("int4 GEMM (compress::w4a16_*)", ("compress::w4a16",)),
    ("int8 GEMM (compress::w8a8_*)", ("compress::w8a8",)),
    ("dense matmul (aten::mm/addmm/linear)", ("aten::mm", "aten::addmm")),
    ("attention", ("compress::decode_attention", "aten::_scaled_dot_product", "aten::scaled_dot_product")),
    ("norms (compress::rms_norm, add_rms_norm)", ("compress::rms_norm", "compress::add_rms_norm")),
]
OTHER = "other ops (views, copies, elementwise, sampling)"


class ProfiledPlan:
    """A model's DecodePlan whose decode_tokens() and step() show in torch.profiler as one
    event each (the plan is a pybind11 object, not a torch op, so the profiler would not
    see it otherwise)."""

    def __init__(self, plan):
        self.plan = plan
        self.has_head = plan.has_head

    def decode_tokens(self, *args):
        with torch.profiler.record_function(DECODE_EVENT):
            return self.plan.decode_tokens(*args)

    def step(self, *args):
        with torch.profiler.record_function(PLAN_EVENT):
            return self.plan.step(*args)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", help="a compress checkpoint")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32, help="tokens generated in the profiled run")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--module-path", action="store_true",
                   help="run decode layers op by op instead of one compress::decode_layer call each")
    p.add_argument("--per-layer-op", action="store_true",
                   help="one compress::decode_layer op call per layer instead of one DecodePlan call per step")
    args = p.parse_args(argv)

    from compress.runtime import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.path, threads=args.threads)
    if args.module_path:
        llm.model.fused_decode = False
    if args.per_layer_op or llm.model.decode_plan is None:
        llm.model.decode_plan = None
    else:
        llm.model.decode_plan = ProfiledPlan(llm.model.decode_plan)
    prompt = [(7 * i) % (llm.config.vocab_size - 10) + 5 for i in range(args.prompt_len)]
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up

    def profiled(tokens: int):
        """Self time and calls per op group of one generate() of ``tokens`` tokens."""
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))[0]
        times: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for evt in prof.key_averages():
            group = next((g for g, prefixes in GROUPS if evt.key.startswith(prefixes)), OTHER)
            times[group] += evt.self_cpu_time_total
            calls[group] += evt.count
        return out.metrics, times, calls

    # the prefill (and first token) is the same in both runs: the difference is the decode steps
    _, t_prefill, c_prefill = profiled(1)
    m, t_all, c_all = profiled(args.tokens)
    steps = args.tokens - 1
    print(f"decode: {m['decode_steps']} steps in {m['decode_s'] * 1e3:.1f} ms = "
          f"{m['decode_s'] / m['decode_steps'] * 1e3:.2f} ms/token ({m['decode_steps'] / m['decode_s']:.1f} tok/s) "
          f"under the profiler; per-group figures below are (run of {args.tokens} tokens - run of 1) / {steps}")
    per_token = {g: (t_all[g] - t_prefill[g]) / 1e3 / steps for g in t_all}
    whole = sum(per_token.values())
    print(f"{'group':<52} {'ms/token':>9} {'share':>7} {'calls/token':>12}")
    for g in [name for name, _ in GROUPS] + [OTHER]:
        print(f"{g:<52} {per_token.get(g, 0.0):>9.2f} {100 * per_token.get(g, 0.0) / whole:>6.1f}% "
              f"{(c_all[g] - c_prefill[g]) / steps:>12.0f}")
    print(f"{'all ops':<52} {whole:>9.2f} {100.0:>6.1f}%")
    step_ms = m["decode_s"] / m["decode_steps"] * 1e3
    print(f"{'outside any op (Python between ops, profiler)':<52} {step_ms - whole:>9.2f}   of a "
          f"{step_ms:.2f} ms step")


if __name__ == "__main__":
    main()
