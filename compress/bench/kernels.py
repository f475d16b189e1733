"""``compress bench kernels``: our CPU kernels against PyTorch and bitsandbytes on real
model shapes, timed A B A B in one run, beside the DRAM read bandwidth measured in the
same command (the limit for M = 1) and the compute peak of the tiles' instruction mixes
(the limit for large M)."""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from compress import ops
from compress.bench.bandwidth import last_level_cache_bytes, read_bandwidth, read_buffer
from compress.bench.compute import compute_peaks, fp32_peak, w8a8_recipe
from compress.io.files import atomic_write_text
from compress.ops import reference
from compress.ops.reference import (W8_LANES_MAX_K, w4a8_lanes_supported, w4a8_prepare_lanes, w4a16_prepare_cpu,
                                    w8a8_prepare_lanes, w8a8_tile_cpu)
from compress.runtime.hugepages import huge_page_copy
from compress.cli_args import positive_int

# (N out, K in) from Llama-2-7B (4096x4096, 11008x4096, 4096x11008), Mistral/Llama-3
# MLP (14336x4096) and a 2048-hidden model's MLP (2048x8192).
DEFAULT_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (2048, 8192)]
DEFAULT_MS = [1, 4, 16, 64, 256]
# M = 1 only: Llama-2-70B / Llama-3-70B MLP up and down (28672x8192, 8192x28672), whose
# packed weights (127 MB int4, 235 MB int8) exceed any last-level cache this runs on, so
# the decode GEMV streams from DRAM the whole call (the shapes above fit a 32 MiB L3 in
# int4 and are only DRAM-bound because the bench flushes the cache before each call).
STREAM_SHAPES = [(28672, 8192), (8192, 28672)]
M1_TARGET = 0.85  # issue 3: int4 / int8 M = 1 at >= 85% of the best read bandwidth
LARGE_M_TARGET = 2.0  # issue 3: int8 at M >= 64 at >= 2x fp32 matmul
GROUP = 128
OUTLIER_FRACTION = 0.005


@dataclass
class Record:
    op: str
    implementation: str
    M: int
    N: int
    K: int
    median_s: float
    weight_bytes: int
    gbps: float
    gflops: float


@dataclass
class Case:
    op: str           # what is computed: "w4a16", "w8a8", "w8a8_outlier", "dense"
    implementation: str
    fn: Callable[[], torch.Tensor]
    weight_bytes: int

    @property
    def key(self) -> str:
        """``op|implementation``: what time_cases' medians and warmers are keyed by."""
        return f"{self.op}|{self.implementation}"


def _int4_weights(n: int, k: int, group: int):
    g = torch.Generator().manual_seed(0)
    u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    return u, reference.pack_int4(u), scales, zeros


# which same-size read (build_cases, M = 1) each of our ops is held against
READ_LABEL = {"w4a16": "int4", "w4a8": "int4", "w8a8": "int8", "w8a8_outlier": "int8"}


def _same_size_read(label: str) -> str:
    return f"stream_read_sum {label} bytes"


def build_cases(m: int, n: int, k: int, impls: set[str] | None) -> list[Case]:
    """Every implementation for one (M, N, K); weights built once per shape by the caller
    would save time, but per-shape build keeps memory bounded. Weights (not bitsandbytes',
    which its layers own) live in 2 MiB pages where the platform allows, as the runtime
    keeps its prepared weights: the ratios compare kernels, not page sizes."""
    want = (lambda name: impls is None or name in impls)
    cases: list[Case] = []
    x32 = torch.randn(m, k)
    x16 = x32.to(torch.bfloat16)
    u, qweight, scales, zeros = _int4_weights(n, k, GROUP)
    int4_bytes = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel()
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s8 = torch.rand(n) * 0.01 + 1e-3
    int8_bytes = q8.numel() + s8.numel() * 4
    c = max(1, int(round(k * OUTLIER_FRACTION)))
    idx = torch.randperm(k)[:c].sort().values
    ow = torch.randn(n, c, dtype=torch.float16) * 0.02
    # the runtime's entries: int4 row-tiled qweight, fp32 scales, uint8 zeros; int8
    # row-tiled qweight; made at load time, outside the timing
    qtiled, scale32, zeros8 = (huge_page_copy(t) for t in w4a16_prepare_cpu(qweight, scales, zeros))
    prepared_bytes = qtiled.numel() * 4 + scale32.numel() * 5
    q8t = huge_page_copy(w8a8_tile_cpu(q8))
    w4 = torch.ops.compress.w4a16_gemm_prepared
    w48 = torch.ops.compress.w4a8_gemm_prepared
    w8 = torch.ops.compress.w8a8_gemm_prepared
    w8o = torch.ops.compress.w8a8_outlier_gemm_prepared

    if want("compress"):
        cases += [
            Case("w4a16", "compress fp32", lambda: w4(x32, qtiled, scale32, zeros8, GROUP), prepared_bytes),
            Case("w4a16", "compress bf16", lambda: w4(x16, qtiled, scale32, zeros8, GROUP), prepared_bytes),
            # the same weights with int8 activation blocks (LLM(w4_activations="int8"))
            Case("w4a8", "compress fp32", lambda: w48(x32, qtiled, scale32, zeros8, GROUP), prepared_bytes),
            Case("w8a8", "compress fp32", lambda: w8(x32, q8t, s8), int8_bytes),
            Case("w8a8", "compress bf16", lambda: w8(x16, q8t, s8), int8_bytes),
            Case("w8a8_outlier", "compress fp32", lambda: w8o(x32, q8t, s8, idx, ow),
                 int8_bytes + ow.numel() * 2),
        ]
    if want("compress"):
        # the weight-row-lane layouts the runtime prepares on AVX-512 VNNI CPUs without AMX
        # (int4 also on AVX2): ratios against the row-tiled ops above
        if w4a8_lanes_supported(k, GROUP):
            ql, sl, zl = (huge_page_copy(t) for t in w4a8_prepare_lanes(qweight, scales, zeros))
            lanes_bytes = ql.numel() * 4 + sl.numel() * 5
            w4l, w48l = torch.ops.compress.w4a16_gemm_lanes, torch.ops.compress.w4a8_gemm_lanes
            cases += [Case("w4a16", "compress lanes fp32", lambda: w4l(x32, ql, sl, zl, GROUP, n), lanes_bytes),
                      Case("w4a8", "compress lanes fp32", lambda: w48l(x32, ql, sl, zl, GROUP, n), lanes_bytes)]
        if k <= W8_LANES_MAX_K:
            q8l, s8l, r8l = (huge_page_copy(t) for t in w8a8_prepare_lanes(q8, s8))
            w8l = torch.ops.compress.w8a8_gemm_lanes
            cases.append(Case("w8a8", "compress lanes fp32", lambda: w8l(x32, q8l, s8l, r8l, n),
                              q8l.numel() + s8l.numel() * 8))
    if want("compress") and m == 1:
        # the same bytes read by the bandwidth probe's loop, cold, in the same rounds: what
        # M = 1 could reach in this sitting (the 1 GiB probe before / after drifts with it)
        for label, nbytes in (("int4", prepared_bytes), ("int8", int8_bytes)):
            buf, _ = read_buffer(nbytes)
            cases.append(Case("read", _same_size_read(label),
                              lambda buf=buf: torch.ops.compress.stream_read_sum(buf), buf.numel() * 8))
    if want("torch"):
        wf = huge_page_copy(torch.randn(n, k) * 0.02)
        wb = huge_page_copy(wf.to(torch.bfloat16))
        cases += [
            Case("dense", "torch matmul fp32", lambda: x32 @ wf.t(), wf.numel() * 4),
            Case("dense", "torch matmul bf16", lambda: x16 @ wb.t(), wb.numel() * 2),
        ]
        s8b = s8.to(torch.bfloat16)
        q8h = huge_page_copy(q8)
        cases.append(Case("w8a8", "torch _weight_int8pack_mm bf16",
                          lambda: torch.ops.aten._weight_int8pack_mm(x16, q8h, s8b), int8_bytes))
        packed = huge_page_copy(torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32), 2))
        # torch's convention: w = (q - 8) * scale + zero  ->  zero = (8 - z) * scale
        sf = scales.float().t()
        sz = torch.stack([sf, (8 - zeros.float().t()) * sf], -1)
        sz16, sz32 = huge_page_copy(sz.to(torch.bfloat16).contiguous()), huge_page_copy(sz.contiguous())
        cases.append(Case("w4a16", "torch _weight_int4pack_mm bf16",
                          lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x16, packed, GROUP, sz16), int4_bytes))
        if m <= 4:  # its fp32-activation path is ~30x slower than bf16; seconds per call beyond
            cases.append(Case("w4a16", "torch _weight_int4pack_mm fp32",
                              lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x32, packed, GROUP, sz32),
                              int4_bytes))
    if want("bnb"):
        cases += _bnb_cases(x32, x16, n, k)
    return cases


def _bnb_cases(x32, x16, n: int, k: int) -> list[Case]:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return []
    lin = torch.nn.Linear(k, n, bias=False)
    out = []
    l8 = bnb.nn.Linear8bitLt(k, n, bias=False, has_fp16_weights=False, threshold=0.0)
    l8.load_state_dict(lin.state_dict())
    l8 = l8.to("cpu").eval()  # eval(): bitsandbytes' CPU fast path
    out.append(Case("w8a8", "bitsandbytes int8", torch.no_grad()(lambda: l8(x32)), n * k + n * 4))
    l8o = bnb.nn.Linear8bitLt(k, n, bias=False, has_fp16_weights=False, threshold=6.0)
    l8o.load_state_dict(lin.state_dict())
    l8o = l8o.to("cpu").eval()
    xo = x32.clone()
    xo[:, : max(1, int(round(k * OUTLIER_FRACTION)))] *= 40.0
    out.append(Case("w8a8_outlier", "bitsandbytes int8 t=6", torch.no_grad()(lambda: l8o(xo)), n * k + n * 4))
    l4 = bnb.nn.Linear4bit(k, n, bias=False, quant_type="nf4", compute_dtype=torch.bfloat16)
    l4.load_state_dict(lin.state_dict())
    l4 = l4.to("cpu").eval()
    out.append(Case("w4a16", "bitsandbytes nf4 bf16", torch.no_grad()(lambda: l4(x16)), n * k // 2 + n * k // 64 * 4))
    return out


# Rows of the small call of the same case that warms the code between the eviction and
# the timed call (see time_cases): enough n-blocks that both threads of a 2-thread run work.
WARM_CODE_ROWS = 256
EVICT_BYTES = 256 << 20  # the least eviction read: larger than most CPUs' last-level cache
EVICT_MAX_BYTES = 2 << 30


def evict_bytes(llc: int | None) -> int:
    """How much the cache evictor reads: twice the last-level cache the OS reports (the
    Xeon development VM reported 480 MiB), at least EVICT_BYTES, at most EVICT_MAX_BYTES."""
    return min(EVICT_MAX_BYTES, max(EVICT_BYTES, 2 * llc if llc else 0))


def _cache_evictor(nbytes: int = EVICT_BYTES):
    """Reads ``nbytes`` (untimed; larger than the last-level cache, see evict_bytes), so
    the next call finds its weights in DRAM, as a decode step does, not in a cache warmed
    by the last call."""
    buf = torch.ones(nbytes // 8, dtype=torch.int64)
    if ops.native_available("cpu"):
        return lambda: torch.ops.compress.stream_read_sum(buf)
    return lambda: buf.sum()


def time_cases(cases: list[Case], reps: int, budget_s: float, evict=None,
               warmers: dict[str, Callable[[], object]] | None = None) -> dict[str, float]:
    """A B A B: each round calls every case once; medians per case. ``evict`` (e.g.
    :func:`_cache_evictor`) runs untimed before every timed call, then the case's entry
    of ``warmers`` (keyed ``op|implementation``; a small call of the same code on other
    weights), so the timed call finds its weights in DRAM and its code in cache, as a
    decode step's GEMV does."""
    evict = evict or (lambda: None)
    warmers = warmers or {}
    for c in cases:  # warm-up (and first-touch)
        c.fn()
    times: dict[str, list[float]] = {c.key: [] for c in cases}
    t_start = time.perf_counter()
    for r in range(reps):
        for c in cases:
            evict()
            if c.key in warmers:
                warmers[c.key]()
            t0 = time.perf_counter()
            c.fn()
            times[c.key].append(time.perf_counter() - t0)
        if r >= 2 and time.perf_counter() - t_start > budget_s:
            break
    return {key: statistics.median(v) for key, v in times.items()}


def run(shapes, ms, impls=None, reps: int = 7, budget_s: float = 20.0, threads: int | None = None,
        bandwidth_bytes: int = 1 << 30, log=print, cold: bool = True, stream_shapes=(),
        warm_code: bool = True) -> dict:
    """Every (N, K) in ``shapes`` at every M in ``ms``, then every (N, K) in
    ``stream_shapes`` at M = 1 only (when 1 is in ``ms``). ``cold``: evict the caches
    before every timed call; ``warm_code``: then run each case once on WARM_CODE_ROWS
    rows of other weights, so only the weights are cold (False: code and data alike)."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    bw_before = read_bandwidth(bandwidth_bytes)
    llc = last_level_cache_bytes()
    evict_size = evict_bytes(llc)
    warm_code = cold and warm_code
    log(f"# {f'cold caches: a {evict_size >> 20} MiB read before every timed call' if cold else 'warm caches'}"
        f"{f', then the same call on {WARM_CODE_ROWS} rows of other weights (weights cold, code warm)' if warm_code else ''}")
    log(f"# threads={torch.get_num_threads()} isa={ops.cpu_isa() if ops.native_available('cpu') else 'none'} "
        f"DRAM read bandwidth (stream_read_sum over {bandwidth_bytes >> 20} MiB"
        f"{' in 2 MiB pages, as the weights' if bw_before['huge_pages'] else ''}): "
        f"median {bw_before['median_gbps']:.1f} GB/s, best {bw_before['best_gbps']:.1f} GB/s")
    peaks = compute_peaks()
    if peaks:
        log("# compute peak (register-only loops of the tiles' instruction mix, "
            f"{torch.get_num_threads()} threads): " + ", ".join(
                f"{name} {p['median_gmacs']:.1f} GMAC/s" for name, p in peaks.items()))
    evict = _cache_evictor(evict_size) if cold else None  # one buffer for the whole sweep
    records: list[Record] = []
    header = f"{'op':<13} {'implementation':<32} {'M':>4} {'N':>6} {'K':>6} {'median ms':>10} {'GB/s':>7} {'GFLOP/s':>8}  ratios"
    log(header)
    configs = [(n, k, m) for n, k in shapes for m in ms] + [(n, k, 1) for n, k in stream_shapes if 1 in ms]
    for n, k, m in configs:
        cases = build_cases(m, n, k, impls)
        warmers = {c.key: c.fn for c in build_cases(m, min(n, WARM_CODE_ROWS), k, impls)} if warm_code else None
        med = time_cases(cases, reps, budget_s, evict, warmers)
        recs = []
        for c in cases:
            t = med[c.key]
            recs.append(Record(c.op, c.implementation, m, n, k, t, c.weight_bytes, c.weight_bytes / t / 1e9,
                               2 * m * n * k / t / 1e9))
        by_impl = {(r.op, r.implementation): r for r in recs}
        for r in recs:
            log(f"{r.op:<13} {r.implementation:<32} {m:>4} {n:>6} {k:>6} {r.median_s * 1e3:>10.3f} "
                f"{r.gbps:>7.1f} {r.gflops:>8.1f}  {_ratios(r, by_impl)}")
        records += recs
        del cases, warmers
    bw_after = read_bandwidth(bandwidth_bytes)
    log(f"# DRAM read bandwidth after the sweep: median {bw_after['median_gbps']:.1f} GB/s, "
        f"best {bw_after['best_gbps']:.1f} GB/s")
    best = max(bw_before["best_gbps"], bw_after["best_gbps"])
    m1 = [r for r in records if r.M == 1 and r.implementation.startswith("compress")]
    reads = {(r.N, r.K, r.implementation): r for r in records if r.M == 1 and r.op == "read"}

    def same_read(r: Record) -> Record | None:
        return reads.get((r.N, r.K, _same_size_read(READ_LABEL[r.op])))

    for r in m1:
        where = "" if llc is None else ", > LLC" if r.weight_bytes > llc else ", fits the LLC"
        read = same_read(r)
        same = f", {100 * r.gbps / read.gbps:5.1f}% of a same-size read in the same rounds" if read else ""
        log(f"# M=1 {r.op:<13} {r.implementation:<15} {r.N}x{r.K} ({r.weight_bytes / 2**20:.0f} MiB{where}): "
            f"{r.gbps:5.1f} GB/s = {100 * r.gbps / best:5.1f}% of best read bandwidth{same}")
    if llc is not None:
        for op in ("w4a16", "w8a8"):
            rs = [r for r in m1 if r.op == op and r.weight_bytes > llc]
            big = [100 * r.gbps / best for r in rs]
            if big:
                line = (f"# M=1 {op} on matrices larger than the {llc >> 20} MiB last-level cache: "
                        f"{min(big):.1f}-{max(big):.1f}% of best read bandwidth over {len(big)} cases "
                        f"(target {100 * M1_TARGET:.0f}%: {'met' if min(big) >= 100 * M1_TARGET else 'missed'})")
                same = [100 * r.gbps / read.gbps for r in rs if (read := same_read(r)) is not None]
                if same:
                    line += f"; {min(same):.1f}-{max(same):.1f}% of a same-size read in the same rounds"
                log(line)
    _large_m_summary(records, peaks, log, **_current_w8a8_paths())
    return {"bandwidth": {"before": bw_before, "after": bw_after, "best_gbps": best},
            "last_level_cache_bytes": llc, "compute_peaks": peaks,
            "threads": torch.get_num_threads(),
            "isa": ops.cpu_isa() if ops.native_available("cpu") else None,
            "records": [asdict(r) for r in records]}


def _current_w8a8_paths() -> dict:
    """What the W8A8 ops take now: the active ISA and the many-row thresholds (AMX: None
    where the CPU or OS does not allow it), as _large_m_summary's keywords."""
    if not ops.native_available("cpu"):
        return {"isa": "scalar", "int16_min_rows": 1 << 62, "amx_min_rows": None}
    return {"isa": ops.cpu_isa(), "int16_min_rows": ops.w8a8_int16_min_rows(),
            "amx_min_rows": ops.w8a8_amx_min_rows() if ops.w8a8_amx_available() else None}


def _large_m_summary(records: list[Record], peaks: dict, log, *, isa: str, int16_min_rows: int,
                     amx_min_rows: int | None = None) -> None:
    """int8 at M >= 64 against fp32 matmul and against the compute peaks: an int8 GEMM on
    this CPU can be at most (int8 peak / fp32 peak) x an fp32 GEMM that runs at its peak
    (the fp32 peak: AVX-512 FMAs where the CPU has them, as MKL uses). Each record is held
    against the peak of the instruction mix its M runs on ``isa`` with those thresholds
    (compute.w8a8_recipe; ``amx_min_rows`` None: no AMX)."""
    fp32 = {(r.M, r.N, r.K): r for r in records if r.implementation == "torch matmul fp32"}
    fp32_recipe, fp32_best = fp32_peak(peaks)
    ratios = []
    used = {}  # recipe -> its peak, for the closing line
    for r in records:
        if r.op != "w8a8" or not r.implementation.startswith("compress") or "lanes" in r.implementation or r.M < 64:
            continue
        base = fp32.get((r.M, r.N, r.K))
        gmacs = r.gflops / 2
        parts = [f"{gmacs:.1f} GMAC/s"]
        recipe = w8a8_recipe(r.M, isa, int16_min_rows, amx_min_rows)
        if recipe in peaks:
            used[recipe] = peaks[recipe]
            parts.append(f"{100 * gmacs / peaks[recipe]['median_gmacs']:.0f}% of the {recipe} peak")
        if base is not None:
            ratios.append(base.median_s / r.median_s)
            parts.append(f"{ratios[-1]:.2f}x fp32 matmul")
            if fp32_best:
                parts.append(f"which runs at {100 * base.gflops / 2 / fp32_best['median_gmacs']:.0f}% of the "
                             f"{fp32_recipe} peak")
        log(f"# M={r.M:<4} w8a8 {r.implementation:<15} {r.N}x{r.K}: " + ", ".join(parts))
    if ratios:
        line = (f"# int8 M>=64 vs fp32 matmul: {min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} cases "
                f"(target {LARGE_M_TARGET:.0f}x: {'met' if min(ratios) >= LARGE_M_TARGET else 'missed'})")
        if used and fp32_best:
            line += f"; compute peak / {fp32_recipe} peak on this CPU: " + ", ".join(
                f"{recipe} {p['median_gmacs'] / fp32_best['median_gmacs']:.2f}" for recipe, p in used.items())
        log(line)


def _ratios(r: Record, by_impl: dict) -> str:
    """Speed-ups of our kernels over the baselines measured in the same round."""
    if not r.implementation.startswith("compress"):
        return ""
    base = {
        "w4a16": ["torch _weight_int4pack_mm bf16", "torch matmul fp32", "bitsandbytes nf4 bf16"],
        "w8a8": ["torch _weight_int8pack_mm bf16", "torch matmul fp32", "bitsandbytes int8"],
        "w8a8_outlier": [],
        "w4a8": ["torch _weight_int4pack_mm bf16", "torch matmul fp32"],
    }[r.op]
    parts = []
    for b in base:
        # the int4 baselines are recorded under w4a16 (the same weights)
        own = "w4a16" if r.op == "w4a8" else r.op
        key = (own, b) if (own, b) in by_impl else ("dense", b)
        if key in by_impl:
            parts.append(f"{by_impl[key].median_s / r.median_s:.2f}x {b.replace('torch ', '')}")
    if "lanes" in r.implementation and (r.op, "compress fp32") in by_impl:
        parts.insert(0, f"{by_impl[(r.op, 'compress fp32')].median_s / r.median_s:.2f}x the row-tiled compress fp32")
    if r.op == "w8a8_outlier" and ("w8a8", r.implementation) in by_impl:
        parts.append(f"{r.median_s / by_impl[('w8a8', r.implementation)].median_s:.3f}x time of w8a8")
    return ", ".join(parts)


def main(args) -> int:
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes] if args.shapes else DEFAULT_SHAPES
    ms = args.m or DEFAULT_MS
    impls = set(args.impl) if args.impl else None
    if args.isa:
        ops.set_cpu_isa(args.isa)
    result = run(shapes, ms, impls, reps=args.reps, budget_s=args.budget, threads=args.threads,
                 bandwidth_bytes=int(args.bandwidth_mib) << 20, cold=not args.warm, warm_code=not args.cold_code,
                 stream_shapes=[] if args.shapes else STREAM_SHAPES)
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=1))
        print(f"# wrote {args.json}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--shapes", nargs="*",
                   help="NxK (out x in) shapes, e.g. 11008x4096 (default: five Llama/Mistral shapes at every M, "
                        "and two 70B MLP shapes larger than the last-level cache at M=1)")
    p.add_argument("--m", type=int, nargs="*", help="batch rows M (default 1 4 16 64 256)")
    p.add_argument("--impl", nargs="*", choices=["compress", "torch", "bnb"], help="implementations to run")
    p.add_argument("--isa", choices=["auto", "avx512_vnni", "avx2", "scalar"], help="cap our kernels' ISA")
    p.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--reps", type=int, default=7, help="A B A B rounds per configuration")
    p.add_argument("--budget", type=float, default=20.0, help="seconds per configuration before stopping early (>= 3 rounds)")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="bandwidth probe buffer size")
    p.add_argument("--warm", action="store_true",
                   help="keep caches warm between calls (default: flush them, so M=1 streams weights from DRAM)")
    p.add_argument("--cold-code", action="store_true",
                   help="after the flush, time the call with its code cold too (default: a 256-row call of the "
                        "same op on other weights runs first, so only the weights come from DRAM, as in decode)")
    p.add_argument("--json", help="write the records to this file")
