"""A many-row kernel path against the tiles it replaces, measured in one process: the
machinery of the lab ``csrc/cpu/lab/ab_many_rows.py``.

Paths: ``int16``, the W8A8 int16 GEMM (csrc/cpu/w8a8_i16_avx2.inc) against the byte
tiles (AVX2 CPUs without VNNI); ``amx``, the W8A8 AMX-INT8 tiles (csrc/cpu/w8a8_amx.inc)
against the VNNI tiles; ``w4-amx``, the W4A16 AMX-BF16 tiles (csrc/cpu/w4a16_amx.inc)
against the int8 tiles (CPUs with AMX); ``w4-lanes-amx``, the lanes op's AMX-INT8 tiles
(csrc/cpu/w4a8_lanes_amx.inc) against its AVX-512 tiles, both on the lanes layout
(``w4a8_gemm_lanes``); ``w4-panel``, the W4A8 panel GEMM (csrc/cpu/w4a8_panel.inc) against
the four-row int8 tiles (AVX-512 VNNI); ``w4-float-panel``, the float op's panel GEMM (csrc/cpu/w4a16_panel.inc) against its register tiles and
at::mm. Elsewhere both settings run the same kernel.

Each round calls the prepared op (``w8a8_gemm_prepared``, or ``w4a8_gemm_prepared``
with groups of 128; fp32 x, row-tiled weights, warm caches) with the path on and off
(its row threshold: compress.ops.set_w8a8_int16_min_rows / set_w8a8_amx_min_rows /
set_w4a16_amx_min_rows / set_w4a8_lanes_amx_min_rows, the last on ``w4a8_gemm_lanes``)
and fp32 ``matmul``, alternating, so the machine's drift hits all three alike. The W8A8 paths must give the same bits; the W4A16 AMX path rounds
differently (bf16), so the SQNR between the two sides must stay above 40 dB (20 dB for a
whole model's logits). ``prefill_ab`` does the same for the prefill of a packed
checkpoint (one sequence per prompt length, the runtime's cache-free forward, whose
linears run at M = the prompt length); ``decode_ab`` times its decode steps at a batch of
rows (the engine's native decode step, whose linears run at M = the rows)."""
from __future__ import annotations

import statistics
import time
from typing import Callable, NamedTuple

import torch

from compress import ops
from compress.accuracy import sqnr_db

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
    "w4-lanes-amx": ManyRowPath(ops.set_w4a8_lanes_amx_min_rows, ops.w4a8_lanes_amx_min_rows, "amx", "lanes",
                                "W4A8 lanes AMX tiles", True),
    "w4-panel": ManyRowPath(ops.set_w4a8_panel_min_rows, ops.w4a8_panel_min_rows, "panel", "rows4",
                            "W4A8 panel GEMM", False),
    "w4-float-panel": ManyRowPath(ops.set_w4a16_panel_min_rows, ops.w4a16_panel_min_rows, "panel", "tiles|mm",
                                  "W4A16 float panel GEMM", False),
}
# The int4 paths run the int8-activation op (w4a8_gemm_prepared) and, with --model, a
# model built with w4_activations="int8"; the float panel the float op (w4a16_gemm_prepared).
W4_PATHS = ("w4-amx", "w4-panel", "w4-lanes-amx")
W4_FLOAT_PATHS = ("w4-float-panel",)
# Least SQNR between the two sides of an inexact path: one GEMM, and a whole model's
# logits, where the two roundings compound over every layer (the 345M benchmark Llama's
# int4 export read ~32 dB)
MIN_SQNR_DB = {"gemm": 40.0, "logits": 20.0}


class Comparison(NamedTuple):
    ok: bool
    note: str  # what to print about the two sides' outputs ("" when exact and equal)
    sqnr_db: float | None  # inexact paths only


class GemmAB(NamedTuple):
    m: int
    n: int
    k: int
    gmacs: dict[str, float]  # median GMAC/s of each side and of fp32 matmul
    comparison: Comparison


class PrefillAB(NamedTuple):
    tokens: int
    tokens_per_s: dict[str, float]  # median prefill tokens/s of each side
    comparison: Comparison


def compare_outputs(a: torch.Tensor, b: torch.Tensor, exact: bool, what: str = "gemm") -> Comparison:
    """Whether the two sides' outputs agree, and what to print about them; for logits of
    an inexact path also how many rows' greedy tokens are the same."""
    if exact:
        same = torch.equal(a, b)
        return Comparison(same, "" if same else "   OUTPUTS DIFFER", None)
    db = sqnr_db(b.float(), a.float())
    note = f"   sqnr(on, off) {db:.1f} dB"
    if what == "logits":
        same = (a.argmax(-1) == b.argmax(-1)).reshape(-1)
        note += f", greedy token the same in {int(same.sum())} of {same.numel()}"
    ok = db > MIN_SQNR_DB[what]
    return Comparison(ok, note + ("" if ok else " TOO LOW"), db)


def usable(path: str) -> bool:
    """Whether this CPU (at the current ISA cap) takes the path at all."""
    isa = ops.cpu_isa()
    return {"int16": isa == "avx2", "amx": isa == "avx512_vnni" and ops.w8a8_amx_available(),
            "w4-amx": isa == "avx512_vnni" and ops.w4a16_amx_available(),
            "w4-lanes-amx": isa == "avx512_vnni" and ops.w8a8_amx_available(),
            "w4-panel": isa == "avx512_vnni", "w4-float-panel": isa == "avx512_vnni"}[path]


def default_path() -> str:
    return "amx" if usable("amx") else "int16"


def _prepared_gemm(path: str, n: int, k: int, g: torch.Generator):
    """The path's prepared op on random weights of N x K: a function of x."""
    from compress.ops.reference import pack_int4, w4a8_prepare_lanes, w4a16_prepare_cpu, w8a8_tile_cpu

    if path in W4_PATHS + W4_FLOAT_PATHS:
        group = 128 if k % 128 == 0 else 32
        canonical = (pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)),
                     (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half(),
                     torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8))
        if path == "w4-lanes-amx":
            lanes = w4a8_prepare_lanes(*canonical)
            return lambda x: torch.ops.compress.w4a8_gemm_lanes(x, *lanes, group, n)
        prepared = w4a16_prepare_cpu(*canonical)
        op = torch.ops.compress.w4a16_gemm_prepared if path in W4_FLOAT_PATHS else torch.ops.compress.w4a8_gemm_prepared
        return lambda x: op(x, *prepared, group)
    q = w8a8_tile_cpu(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8))
    s = torch.rand(n, generator=g) * 0.01 + 1e-3
    return lambda x: torch.ops.compress.w8a8_gemm_prepared(x, q, s)


def gemm_ab(path: str, m: int, n: int, k: int, rounds: int) -> GemmAB:
    """One GEMM of M x K by N x K with the path on, off, and fp32 matmul, alternating
    ``rounds`` times after an untimed warm-up round; the path's threshold is restored."""
    which = PATHS[path]
    default = which.get_rows()
    g = torch.Generator().manual_seed(0)
    gemm = _prepared_gemm(path, n, k, g)
    x = torch.randn(m, k, generator=g)
    wf = torch.randn(n, k, generator=g)
    runs = {which.on: (1, lambda: gemm(x)), which.off: (NEVER, lambda: gemm(x)), "fp32": (default, lambda: x @ wf.t())}
    times: dict[str, list[float]] = {name: [] for name in runs}
    outs = {}
    try:
        for _ in range(rounds + 1):  # the first round warms up, untimed
            for name, (rows, fn) in runs.items():
                which.set_rows(rows)
                t0 = time.perf_counter()
                outs[name] = fn()
                times[name].append(time.perf_counter() - t0)
    finally:
        which.set_rows(default)
    rate = {name: m * n * k / statistics.median(t[1:]) / 1e9 for name, t in times.items()}
    return GemmAB(m, n, k, rate, compare_outputs(outs[which.on], outs[which.off], which.exact))


def format_gemm_ab(path: str, r: GemmAB) -> str:
    on, off, rate = PATHS[path].on, PATHS[path].off, r.gmacs
    return (f"M={r.m:4d} {r.n:6d}x{r.k:<6d} {on} {rate[on]:6.1f}  {off} {rate[off]:6.1f}  "
            f"fp32 {rate['fp32']:6.1f} GMAC/s   {on}/{off} {rate[on] / rate[off]:.2f}  "
            f"{on}/fp32 {rate[on] / rate['fp32']:.2f}  {off}/fp32 {rate[off] / rate['fp32']:.2f}"
            f"{r.comparison.note}")


def check_model_path(path: str) -> None:
    """ValueError when a checkpoint's layers on this CPU would not reach the path's kernel
    on either side: the lanes op's AMX tiles need the lanes layout, the row-tiled paths
    (w4-amx, w4-panel) the row-tiled one (compress.runtime.layers.int4_lanes_wanted)."""
    from compress.runtime.layers import int4_lanes_wanted

    if path not in W4_PATHS:
        return
    lanes = int4_lanes_wanted("int8")
    if (path == "w4-lanes-amx") != lanes:
        layout = "lanes" if lanes else "row-tiled"
        raise ValueError(f"{path} --model: this CPU's runtime prepares int8-activation int4 layers in the {layout} "
                         "layout (compress.runtime.layers.int4_lanes_wanted), so both sides would run the same "
                         "kernels; time the op without --model")


def prefill_ab(checkpoint: str, path: str, prompt_lengths: list[int], rounds: int) -> list[PrefillAB]:
    """Prefill of a packed checkpoint with the path on and off, per prompt length;
    stops after the first length whose two sides' logits disagree."""
    from compress.runtime.loading import open_checkpoint
    from compress.runtime.model_runner import ModelRunner
    from compress.runtime.models.llama import build_model

    check_model_path(path)
    which = PATHS[path]
    default = which.get_rows()
    model = build_model(open_checkpoint(checkpoint), w4_activations="int8" if path in W4_PATHS else "float")
    results = []
    try:
        for length in prompt_lengths:
            prompt = [(7 * i) % (model.vocab_size - 5) + 5 for i in range(length)]
            times: dict[str, list[float]] = {which.on: [], which.off: []}
            logits = {}
            for _ in range(rounds + 1):  # the first round warms up, untimed
                for name, rows in ((which.on, default), (which.off, NEVER)):
                    which.set_rows(rows)
                    runner = ModelRunner(model, None)
                    t0 = time.perf_counter()
                    logits[name] = model.logits(runner.hidden_states(torch.tensor([prompt]))[:, -1])
                    times[name].append(time.perf_counter() - t0)
            rate = {name: length / statistics.median(t[1:]) for name, t in times.items()}
            results.append(PrefillAB(length, rate, compare_outputs(logits[which.on], logits[which.off],
                                                                   which.exact, "logits")))
            if not results[-1].comparison.ok:
                break
    finally:
        which.set_rows(default)
    return results


class DecodeAB(NamedTuple):
    rows: int
    tokens_per_s: dict[str, float]  # median decode tokens/s (all rows) of each side
    same_tokens: float  # share of generated tokens the two sides agree on (greedy)


def decode_ab(checkpoint: str, path: str, batch_rows: list[int], rounds: int, prompt_len: int = 128,
              new_tokens: int = 33) -> list[DecodeAB]:
    """Decode of a packed checkpoint through the engine with the path on (its default row
    threshold) and off, per batch size: ``rows`` distinct prompts of ``prompt_len``
    tokens prefilled in one step, then ``new_tokens - 1`` greedy decode steps of ``rows``
    rows; tokens/s of those steps (all rows' decode steps over the time from the first
    row's first token to the last row's finish), median over rounds that alternate the
    two sides in one process. ValueError: rows below 1, fewer than 2 new tokens, or a
    path this CPU's layers would not reach (check_model_path)."""
    from compress.bench.synthetic import synthetic_prompts
    from compress.runtime import LLM, SamplingParams

    if min(batch_rows) < 1 or new_tokens < 2:
        raise ValueError(f"decode_ab: rows must be >= 1 and new_tokens >= 2 (a decode step), got rows {batch_rows}, "
                         f"new_tokens {new_tokens}")
    check_model_path(path)
    which = PATHS[path]
    default = which.get_rows()
    activations = "int8" if path in W4_PATHS else "float"
    llm = LLM(checkpoint, enable_prefix_caching=False, max_batch_size=max(32, *batch_rows),
              max_num_batched_tokens=max(512, max(batch_rows) * prompt_len), w4_activations=activations)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    results = []
    try:
        for rows in batch_rows:
            prompts = synthetic_prompts(llm.config.vocab_size, rows, prompt_len)
            rates: dict[str, list[float]] = {which.on: [], which.off: []}
            tokens = {}
            for round_ in range(rounds + 1):  # the first round warms up, untimed
                for name, threshold in ((which.on, default), (which.off, NEVER)):
                    which.set_rows(threshold)
                    outs = llm.generate(prompts, params)
                    if round_:
                        steps = sum(o.metrics["decode_steps"] for o in outs)
                        start = min(o.metrics["first_token_time"] for o in outs)
                        end = max(o.metrics["finish_time"] for o in outs)
                        rates[name].append(steps / (end - start))
                    tokens[name] = [o.token_ids for o in outs]
            pairs = [(a, b) for x, y in zip(tokens[which.on], tokens[which.off]) for a, b in zip(x, y)]
            results.append(DecodeAB(rows, {k: statistics.median(v) for k, v in rates.items()},
                                    sum(a == b for a, b in pairs) / max(1, len(pairs))))
    finally:
        which.set_rows(default)
    return results


def format_decode_ab(path: str, r: DecodeAB) -> str:
    on, off, rate = PATHS[path].on, PATHS[path].off, r.tokens_per_s
    return (f"decode {r.rows:3d} rows: {on} {rate[on]:7.1f}  {off} {rate[off]:7.1f} tok/s   "
            f"{on}/{off} {rate[on] / rate[off]:.2f}   greedy tokens the same: {100 * r.same_tokens:.0f}%")


def format_prefill_ab(path: str, r: PrefillAB) -> str:
    on, off, rate = PATHS[path].on, PATHS[path].off, r.tokens_per_s
    return (f"prefill {r.tokens:5d} tokens: {on} {rate[on]:7.1f}  {off} {rate[off]:7.1f} tok/s   "
            f"{on}/{off} {rate[on] / rate[off]:.2f}{r.comparison.note.replace('OUTPUTS', 'LOGITS')}")
