"""``compress bench profile CKPT --host``: the host's side of a decode step, the engine's
work around the model's forward (scheduler, step inputs, sampler, logprobs, sequence
bookkeeping, detokenizer, stop checks, block manager), in microseconds a step.

On a GPU a decode step's forward is one CUDA-graph replay, so this side sets the step's
length at small batches; here it is measured on any machine by taking the forward out:
each decode step of ``LLMEngine.step`` is timed whole and the forward inside it on its
own (the native plan's call, the graph replay, or the model's ``forward_paged`` and
``logits``), and the host's time is the difference. Three paths: ``native`` (the CPU
default, one native call a step), ``graphs`` (the CUDA-graph plumbing,
``runtime/cuda_graphs.py``, captured with ``capture_eager`` so that its input copies run
on the CPU) and ``module`` (the module path, step descriptors built in Python). A tiny
model keeps the forward from evicting the host's code and data between steps (make one
with ``compress bench make-model --hidden 64 --layers 2 --intermediate 128 --heads 4
--kv-heads 2 --vocab 4096 --exports none``).

Each round queues ``batch`` distinct prompts, prefills them in one step and decodes
``--new-tokens`` greedily (``ignore_eos``); the first round warms up. ``--cprofile N``
adds the top N functions by own time under cProfile, the profiler paused inside the
forward, so the list is the host's side alone."""
from __future__ import annotations

import cProfile
import pstats
import statistics
import time

import torch

from compress.bench.synthetic import synthetic_prompts

PATHS = ("native", "graphs", "module")
SAMPLING = ("greedy", "logprobs", "sample")


class ForwardTimer:
    """Adds up the wall time of the forward calls it wraps (and pauses ``profiler`` in
    them, when one is set)."""

    def __init__(self):
        self.seconds = 0.0
        self.profiler: cProfile.Profile | None = None

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self.profiler is not None:
                self.profiler.disable()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                if self.profiler is not None:
                    self.profiler.enable()
        return timed


class _TimedNative:
    def __init__(self, native, timer: ForwardTimer):
        self.decode = timer.wrap(native.decode)


def load_engine(path, path_kind: str, max_batch: int, timer: ForwardTimer):
    """An ``LLM`` whose decode steps take ``path_kind`` with every forward call timed by
    ``timer``; None where the model has no native plan and ``native`` is asked for."""
    from compress.runtime import LLM
    from compress.runtime.cuda_graphs import DecodeGraphs, capture_eager

    llm = LLM(path, native_decode=path_kind == "native", max_batch_size=max_batch)
    runner = llm.runner
    if path_kind == "native":
        if runner.native is None:
            return None
        runner.native = _TimedNative(runner.native, timer)
    elif path_kind == "graphs":
        runner.graphs = DecodeGraphs(llm.model, llm.engine.kv_cache, max_batch, capture=capture_eager)
        runner.graphs.graphs = {b: (timer.wrap(replay), out) for b, (replay, out) in runner.graphs.graphs.items()}
    else:
        model = llm.model
        model.forward_paged = timer.wrap(model.forward_paged)
        model.logits = timer.wrap(model.logits)
    return llm


def sampling_params(kind: str, new_tokens: int):
    from compress.runtime import SamplingParams

    extra = {"greedy": {}, "logprobs": {"logprobs": 1},
             "sample": {"temperature": 0.8, "top_p": 0.95, "seed": 0}}[kind]
    return SamplingParams(max_tokens=new_tokens, ignore_eos=True, **({"temperature": 0.0} | extra))


def decode_round(llm, timer: ForwardTimer, batch: int, prompt_len: int, params, round_id: int,
                 profiler: cProfile.Profile | None = None) -> tuple[list[float], list[float]]:
    """One round: ``(host seconds, whole seconds)`` of each decode step."""
    engine = llm.engine
    # distinct prompts, round by round (a batch size's rounds never repeat one)
    for i, prompt in enumerate(synthetic_prompts(llm.config.vocab_size, batch, prompt_len, first=round_id * batch)):
        engine.add_request(f"host-{round_id}-{i}", prompt, params)
    engine.step()   # the prefill
    host, whole = [], []
    timer.profiler = profiler
    while engine.has_unfinished():
        timer.seconds = 0.0
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        engine.step()
        if profiler is not None:
            profiler.disable()
        seconds = time.perf_counter() - t0
        whole.append(seconds)
        host.append(seconds - timer.seconds)
    timer.profiler = None
    return host, whole


def measure(llm, timer: ForwardTimer, path_kind: str, batch: int, new_tokens: int, prompt_len: int, rounds: int,
            kind: str, cprofile_top: int = 0, first_round: int = 0) -> dict:
    """Median host and whole microseconds of a decode step of ``batch`` rows on ``llm``
    (from load_engine with ``timer``; ``rounds`` rounds after a warm-up one) and, with
    ``cprofile_top``, the host side's top functions. Rounds are numbered from
    ``first_round`` (their prompts and request ids differ by round: an engine measured
    again takes a later ``first_round``, ``rounds + 2`` on)."""
    params = sampling_params(kind, new_tokens)
    with torch.inference_mode():
        decode_round(llm, timer, batch, prompt_len, params, first_round)
        host, whole = [], []
        for r in range(first_round + 1, first_round + rounds + 1):
            h, w = decode_round(llm, timer, batch, prompt_len, params, r)
            host += h
            whole += w
        result = {"path": path_kind, "batch": batch, "sampling": kind, "steps": len(host),
                  "host_us": statistics.median(host) * 1e6, "step_us": statistics.median(whole) * 1e6}
        if cprofile_top:
            profiler = cProfile.Profile()
            h, _ = decode_round(llm, timer, batch, prompt_len, params, first_round + rounds + 1, profiler)
            result["cprofile"] = top_functions(profiler, len(h), cprofile_top)
    return result


def top_functions(profiler: cProfile.Profile, steps: int, top: int) -> list[dict]:
    """The ``top`` functions by own time: calls, own and cumulative microseconds a step."""
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in pstats.Stats(profiler).stats.items():
        where = name if file == "~" else f"{file.split('/compress/')[-1].split('site-packages/')[-1]}:{line}({name})"
        rows.append({"function": where, "calls": calls / steps, "own_us": own / steps * 1e6,
                     "cumulative_us": cumulative / steps * 1e6})
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


def format_functions(rows: list[dict]) -> str:
    lines = [f"  {'own us':>8} {'cum us':>8} {'calls':>7}  function (a step, under cProfile)"]
    lines += [f"  {r['own_us']:>8.1f} {r['cumulative_us']:>8.1f} {r['calls']:>7.1f}  {r['function']}" for r in rows]
    return "\n".join(lines)


def run_host(args) -> list[dict]:
    """Every (path, sampling, batch) combination; one engine per path, loaded once for the
    largest batch and reused (a batch size's rounds get distinct prompts: synthetic_prompts)."""
    torch.set_num_threads(args.threads)
    results = []
    print(f"# host side of a decode step: median us over {args.rounds} rounds of {args.new_tokens} new tokens "
          f"({args.prompt_len}-token prompts), the forward taken out")
    print(f"{'path':<8} {'sampling':<9} {'batch':>5} {'host us':>9} {'step us':>9} {'host us/row':>12}")
    for path_kind in args.paths:
        timer = ForwardTimer()
        llm = load_engine(args.path, path_kind, max(max(args.batch), 1), timer)
        first_round = 0
        for kind in args.sampling:
            for batch in args.batch:
                if llm is None:
                    print(f"{path_kind:<8} {kind:<9} {batch:>5}  (no native plan for this model here)")
                    continue
                res = measure(llm, timer, path_kind, batch, args.new_tokens, args.prompt_len, args.rounds, kind,
                              args.cprofile, first_round)
                first_round += args.rounds + 2
                results.append(res)
                print(f"{path_kind:<8} {kind:<9} {batch:>5} {res['host_us']:>9.1f} {res['step_us']:>9.1f} "
                      f"{res['host_us'] / batch:>12.2f}")
                if "cprofile" in res:
                    print(format_functions(res["cprofile"]))
        del llm
    return results


def add_host_arguments(p) -> None:
    p.add_argument("--host", action="store_true",
                   help="the host's side of a decode step (us a step, the forward taken out) at --batch sizes")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="--host: rows a step")
    p.add_argument("--new-tokens", type=int, default=64, help="--host: tokens decoded a round")
    p.add_argument("--rounds", type=int, default=3, help="--host: measured rounds (after one warm-up)")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="--host: decode paths")
    p.add_argument("--sampling", nargs="+", choices=SAMPLING, default=["greedy"],
                   help="--host: greedy, greedy with logprobs=1, or seeded temperature 0.8 / top_p 0.95")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="--host: also print the host side's top N functions by own time (cProfile)")
