"""``compress bench profile CKPT``: where a decode step's time goes. Runs greedy
decoding of a checkpoint on our runtime under torch.profiler and prints the time per
decode step by op group; ``--rows N`` decodes N prompts together (a step of N rows, whose
figures are per step, not per token).

By default a decode step is one call of the engine's native decode step
(``runtime/native_decode.py``: the embedding, every layer, the final norm, the lm_head
and the greedy argmax in C++), recorded as one group (NativeDecode.decode), where the
model has one; ``--module-path`` runs the layers op by op (``LLM(native_decode=False)``)
to split the time by op.

Groups: the packed GEMMs (our kernels, lm_head included when it is packed), dense
matmuls, attention, norms, and everything else (views, copies, elementwise ops, the
sampler). Decode only: a 1-token run (prefill) is profiled too and subtracted. The
time of a step that falls in no op is the interpreter between ops and the engine's
scheduling (inflated by the profiler's own cost).

``--host`` measures that engine side instead, in microseconds a decode step with the
forward taken out, on the native, CUDA-graph and module paths (``host_profile.py``)."""
from __future__ import annotations

import json
from collections import defaultdict

import torch

from compress.bench.synthetic import synthetic_prompts
from compress.errors import UserError
from compress.w4_activations import DEFAULT_W4_ACTIVATIONS, W4_ACTIVATIONS
from compress.io.files import atomic_write_text
from compress.cli_args import positive_int

DECODE_EVENT = "NativeDecode.decode"
GROUPS = [
    ("whole step (NativeDecode.decode)", (DECODE_EVENT,)),
    ("int4 GEMM (compress::w4a16_*)", ("compress::w4a16", "compress::w4a8")),
    ("int8 GEMM (compress::w8a8_*)", ("compress::w8a8",)),
    ("dense matmul (aten::mm/addmm/linear)", ("aten::mm", "aten::addmm")),
    ("attention", ("compress::paged_decode_attention", "aten::_scaled_dot_product", "aten::scaled_dot_product")),
    ("norms (compress::rms_norm, add_rms_norm)", ("compress::rms_norm", "compress::add_rms_norm")),
]
OTHER = "other ops (views, copies, elementwise, sampling)"


class ProfileSettingsError(UserError):
    """A profile setting that cannot work (names the option)."""


class ProfiledNative:
    """An engine's native decode step whose decode() shows in torch.profiler as one
    event (it is one C++ call, not a torch op, so the profiler would not see it)."""

    def __init__(self, native):
        self.native = native

    def decode(self, *args):
        with torch.profiler.record_function(DECODE_EVENT):
            return self.native.decode(*args)


def group_of(event_name: str) -> str:
    """The group an op's profiler event counts in."""
    return next((g for g, prefixes in GROUPS if event_name.startswith(prefixes)), OTHER)


def profile_decode(llm, tokens: int, prompt_len: int, rows: int = 1) -> dict:
    """Per-step decode time and calls of each op group: profiles greedy runs of
    ``tokens`` and of 1 token from the same ``rows`` distinct prompts (one batch, so a
    decode step runs ``rows`` rows) and divides the difference by the ``tokens - 1``
    decode steps. Returns ``{"groups": {group: {"ms_per_step",
    "calls_per_step"}}, "step_ms", "ops_ms", "decode_steps", "decode_s"}``."""
    from torch.profiler import ProfilerActivity, profile

    from compress.runtime import SamplingParams

    if tokens < 2:
        raise ProfileSettingsError(f"compress bench profile: --tokens must be at least 2 (one decode step), "
                                   f"got {tokens}")
    if rows < 1:
        raise ProfileSettingsError(f"compress bench profile: --rows must be at least 1, got {rows}")
    if rows > llm.engine.scheduler.max_num_seqs:
        raise ProfileSettingsError(f"compress bench profile: --rows {rows} is more than the engine's "
                                   f"max_batch_size ({llm.engine.scheduler.max_num_seqs})")
    prompts = synthetic_prompts(llm.config.vocab_size, rows, prompt_len)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up

    def profiled(n: int):
        """Self time (us) and calls per op group of one generate() of ``n`` tokens."""
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
        times: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for evt in prof.key_averages():
            group = group_of(evt.key)
            times[group] += evt.self_cpu_time_total
            calls[group] += evt.count
        return out.metrics, times, calls

    # the prefill (and first token) is the same in both runs: the difference is the decode steps
    _, t_prefill, c_prefill = profiled(1)
    metrics, t_all, c_all = profiled(tokens)
    steps = tokens - 1
    groups = {g: {"ms_per_step": (t_all[g] - t_prefill[g]) / 1e3 / steps,
                  "calls_per_step": (c_all[g] - c_prefill[g]) / steps}
              for g in [name for name, _ in GROUPS] + [OTHER]}
    return {"groups": groups, "ops_ms": sum(v["ms_per_step"] for v in groups.values()),
            "step_ms": metrics["decode_s"] / metrics["decode_steps"] * 1e3,
            "decode_steps": metrics["decode_steps"], "decode_s": metrics["decode_s"]}


def format_profile(result: dict, tokens: int, rows: int = 1) -> str:
    steps, secs = result["decode_steps"], result["decode_s"]
    lines = [f"decode: {steps} steps of {rows} row(s) in {secs * 1e3:.1f} ms = {secs / steps * 1e3:.2f} ms/step "
             f"({rows * steps / secs:.1f} tok/s) under the profiler; per-group figures below are "
             f"(run of {tokens} tokens - run of 1) / {tokens - 1}",
             f"{'group':<52} {'ms/step':>9} {'share':>7} {'calls/step':>12}"]
    whole = result["ops_ms"]
    for g, v in result["groups"].items():
        lines.append(f"{g:<52} {v['ms_per_step']:>9.2f} {100 * v['ms_per_step'] / whole:>6.1f}% "
                     f"{v['calls_per_step']:>12.0f}")
    lines.append(f"{'all ops':<52} {whole:>9.2f} {100.0:>6.1f}%")
    lines.append(f"{'outside any op (Python between ops, profiler)':<52} {result['step_ms'] - whole:>9.2f}   "
                 f"of a {result['step_ms']:.2f} ms step")
    return "\n".join(lines)


def main(args) -> int:
    from compress.runtime import LLM

    if args.host:
        from compress.bench.host_profile import run_host

        results = run_host(args)
        if args.json:
            atomic_write_text(args.json, json.dumps({"path": str(args.path), "threads": args.threads,
                                                     "host": results}, indent=1))
            print(f"# wrote {args.json}")
        return 0
    torch.set_num_threads(args.threads)
    llm = LLM(args.path, threads=args.threads, native_decode=not args.module_path, enable_prefix_caching=False,
              max_batch_size=max(32, args.rows), kv_cache_dtype=args.kv_cache_dtype,
              max_num_batched_tokens=max(512, args.rows * args.prompt_len),  # every prompt in one step
              w4_activations=args.w4_activations)
    runner = llm.engine.runner
    if runner.native is not None:
        runner.native = ProfiledNative(runner.native)
    elif not args.module_path:
        print("# this model has no native decode step here: profiling the module path")
    result = profile_decode(llm, args.tokens, args.prompt_len, args.rows)
    print(format_profile(result, args.tokens, args.rows))
    if args.json:
        atomic_write_text(args.json, json.dumps({"path": str(args.path), "threads": args.threads,
                                                 "tokens": args.tokens, "prompt_len": args.prompt_len,
                                                 "rows": args.rows, "w4_activations": llm.w4_activations,
                                                 "kv_cache_dtype": str(llm.kv_cache_dtype).removeprefix("torch."), **result},
                                                indent=1))
        print(f"# wrote {args.json}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("path", help="a compress checkpoint")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--tokens", type=int, default=32, help="tokens generated in the profiled run (>= 2)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rows", type=int, default=1,
                   help="distinct prompts decoded together: rows a decode step (figures are per step)")
    p.add_argument("--w4-activations", choices=W4_ACTIVATIONS, default=DEFAULT_W4_ACTIVATIONS,
                   help="how int4 layers treat their activations (LLM(w4_activations=...))")
    from compress.dtypes import KV_CACHE_DTYPES

    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=None,
                   help="the paged KV cache's element type (default: the runtime's)")
    p.add_argument("--module-path", action="store_true",
                   help="run decode steps op by op through the modules instead of the native one-call step")
    p.add_argument("--json", help="write the per-group figures to this file")
    from compress.bench.host_profile import add_host_arguments

    add_host_arguments(p)
