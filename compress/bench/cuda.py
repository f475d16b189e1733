"""``compress bench cuda``: our CUDA kernels against cuBLAS fp16, PyTorch's own int4
kernel and the roofline, on real model shapes.

For each shape (N x K: 4096x4096, 11008x4096, 4096x11008, 14336x4096) and batch
M = 1..256 it times, with CUDA events, medians over interleaved repetitions (A B A B):
  cublas_fp16   x @ W.t()                   (dense fp16 weights)
  w4a16         w4a16_gemm_shuffled         (int4 g=128, shuffled once up front)
  w8a8          w8a8_gemm                   (includes the activation-quant kernel)
  torch_int4    torch._weight_int4pack_mm   (PyTorch's own int4 kernel, bf16, its packing)
Each kernel's calls are captured into a CUDA graph and replayed, so the time is the
GPU's: launched one by one from Python, a call costs the host ~20 us on a cloud VM,
more than most of these kernels take (that time is printed beside, "launched us").
It prints time, achieved GB/s and TFLOP/s, speed-up over cuBLAS, and the roofline
time max(bytes / bandwidth, flops / peak) of each kernel (bandwidth: a device copy
measured in the same run; peaks: H100 SXM datasheet 989 TFLOP/s fp16, 1979 TOP/s int8;
override with --bw/--fp16/--int8). Each kernel cycles through copies of its weights
totalling >= --rotate-mb, so they stream from HBM as in a model's forward pass, not
from the 50 MB L2.

Needs a CUDA GPU and compress._cuda; says so and measures nothing elsewhere.
``--device cpu`` is a dry run of the same setup, rotation and packing on the reference /
CPU ops (how the tests keep this command exercised without a GPU)."""
from __future__ import annotations

import itertools
import json
import statistics
import time

import torch

from compress.io.files import atomic_write_text

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096)]
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
GROUP = 128
KERNELS = ("cublas_fp16", "w4a16", "w8a8", "torch_int4")


def graphed(fn, inner: int):
    """``inner`` calls of ``fn`` captured into one CUDA graph (after a warm-up run on a
    side stream); returns its replay. The calls' Python work (the weight rotation's
    ``next``) runs once, at capture, so each captured call keeps its own weight copy."""
    from compress.runtime.cuda_graphs import capture_cuda

    replay, _ = capture_cuda(lambda: [fn() for _ in range(inner)], None)
    return replay


def time_fns(fns: dict, reps: int, inner: int, dev: str = "cuda", graphs: bool = False) -> dict[str, float]:
    """Median milliseconds per call of each fn, repetitions interleaved (CUDA events; a
    host clock on the cpu dry run). ``graphs`` (CUDA): each round replays a graph of
    ``inner`` calls, so the figure is the GPU's time, not the host's launch rate."""
    times = {k: [] for k in fns}
    for fn in fns.values():  # warm up
        fn()
    rounds = {k: graphed(fn, inner) for k, fn in fns.items()} if graphs and dev == "cuda" else None
    if dev == "cuda":
        torch.cuda.synchronize()
    for _ in range(reps):
        for name, fn in fns.items():
            if dev != "cuda":
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                times[name].append((time.perf_counter() - t0) * 1e3 / inner)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if rounds is not None:
                rounds[name]()
            else:
                for _ in range(inner):
                    fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def measure_copy_bandwidth(dev: str = "cuda", nbytes: int = 1 << 31) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    src = torch.empty(nbytes // 4, device=dev, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    ms = time_fns({"copy": lambda: dst.copy_(src)}, reps=10, inner=1, dev=dev)["copy"]
    return 2 * nbytes / (ms * 1e-3)


def int4pack_mm(dev: str):
    return torch.ops.aten._weight_int4pack_mm if dev == "cuda" else torch.ops.aten._weight_int4pack_mm_for_cpu


def torch_int4_packing(u: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dev: str):
    """PyTorch's int4 kernel (tinygemm) operands for the same weights: (packed, group
    size, scales-and-zeros). Its dequantization is (q - 8) * s + z, so z = (8 - zero) * s
    makes it the same matrix. Returns the reason as a string where the op is missing."""
    try:
        if dev == "cuda":
            packed = torch.ops.aten._convert_weight_to_int4pack((u[:, ::2] << 4 | u[:, 1::2]).to(dev), 8)
        else:  # the dry run: the CPU form of the op, same operands otherwise
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32), 2)
        s = scales.to(torch.bfloat16)
        z = ((8 - zeros.to(dev).float()) * s.float()).to(torch.bfloat16)
        sz = torch.stack([s.t(), z.t()], dim=-1).contiguous()
        return packed, GROUP, sz
    except (RuntimeError, AttributeError, NotImplementedError) as e:  # op missing or changed in this torch
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _weight_copies(rotate_mb: float, *ts):
    """An endless cycle over ``ts`` and clones of it, totalling >= ``rotate_mb``."""
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    reps = max(1, int(-(-rotate_mb * 1e6 // nbytes)))
    return itertools.cycle([ts] + [tuple(t.clone() for t in ts) for _ in range(reps - 1)])


def _row(n, k, m, name, ms, bw, fp16_peak, int8_peak, launched: dict | None = None) -> dict:
    """One kernel's record: its time, achieved rates and its roofline time."""
    flops = 2.0 * m * n * k
    act = m * k * 2 + m * n * 2
    nbytes = {"cublas_fp16": n * k * 2 + act,
              "w4a16": n * k // 2 + (n * k // GROUP) * 3 + act,
              "w8a8": n * k + n * 4 + act + m * k * 3,
              "torch_int4": n * k // 2 + (n * k // GROUP) * 4 + act}[name]
    peak = int8_peak if name == "w8a8" else fp16_peak
    sec = ms[name] * 1e-3
    roof = max(nbytes / bw, flops / peak)
    return dict(n=n, k=k, m=m, kernel=name, us=sec * 1e6, gbps=nbytes / sec / 1e9, tflops=flops / sec / 1e12,
                speedup=ms["cublas_fp16"] / ms[name], roof_us=roof * 1e6, pct_roof=100 * roof / sec,
                launched_us=None if launched is None else launched[name] * 1e3)


def run(args, log=print) -> dict | None:
    """The sweep of ``args`` (the parser's namespace); None where there is nothing to
    measure (no CUDA device or no compress._cuda)."""
    from compress import ops

    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        log("compress bench cuda: no CUDA device; nothing to measure")
        return None
    if dev == "cuda" and not ops.native_available("cuda"):
        log("compress bench cuda: compress._cuda is not built; nothing to measure")
        return None
    from compress.ops import reference as ref

    C = torch.ops.compress
    dt = getattr(torch, args.dtype)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    bw = args.bw if args.bw is not None else measure_copy_bandwidth(dev)
    device_name = torch.cuda.get_device_name() if dev == "cuda" else "CPU dry run"
    log(f"# {device_name}  roofline: {bw / 1e12:.2f} TB/s, "
        f"{args.fp16 / 1e12:.0f} TFLOP/s fp16, {args.int8 / 1e12:.0f} TOP/s int8")
    use_graphs = dev == "cuda" and not args.no_graphs
    log(f"# us: {'a CUDA graph of --inner calls, replayed (GPU time)' if use_graphs else 'calls launched one by one'}"
        f"{'; launched us: the same calls launched one by one from Python (the host-bound time)' if use_graphs else ''}")
    log(f"{'N x K':>12} {'M':>4} {'kernel':>12} {'us':>9} {'GB/s':>7} {'TFLOP/s':>8} {'vs cuBLAS':>9} "
        f"{'roof us':>8} {'% roof':>6} {'launched us' if use_graphs else ''}")
    rows, notes, int4_errors = [], [], {}
    for n, k in shapes:
        g = torch.Generator(device="cpu").manual_seed(0)
        u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        q4 = ref.pack_int4(u).to(dev)
        s4 = (torch.rand(n, k // GROUP, generator=g) * 0.01).to(dt).to(dev)
        z4 = torch.randint(0, 16, (n, k // GROUP), generator=g, dtype=torch.uint8).to(dev)
        qs, st, zt = C.w4a16_shuffle_for_cuda(q4, s4, z4, GROUP)
        w16 = ref.dequantize_int4(q4, s4, z4, GROUP, dt)
        q8 = torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8)
        s8 = torch.rand(n, device=dev) * 0.01

        w16_sets = _weight_copies(args.rotate_mb, w16)
        w4_sets = _weight_copies(args.rotate_mb, qs, st, zt)
        w8_sets = _weight_copies(args.rotate_mb, q8, s8)
        tinygemm = torch_int4_packing(u, s4, z4, dev)
        t4_sets = _weight_copies(args.rotate_mb, tinygemm[0], tinygemm[2]) if isinstance(tinygemm, tuple) else None
        if t4_sets is None:
            notes.append(f"torch_int4 skipped for {n}x{k}: {tinygemm}")
            log(f"# {notes[-1]}")
        for m in args.m:
            x = torch.randn(m, k, device=dev, dtype=dt)
            xb = x.to(torch.bfloat16)
            fns = {
                "cublas_fp16": lambda: x @ next(w16_sets)[0].t(),
                "w4a16": lambda: C.w4a16_gemm_shuffled(x, *next(w4_sets), GROUP, n),
                "w8a8": lambda: C.w8a8_gemm(x, *next(w8_sets)),
            }
            if t4_sets is not None:
                int4mm = int4pack_mm(dev)
                fns["torch_int4"] = lambda: int4mm(xb, (t4 := next(t4_sets))[0], GROUP, t4[1])
                if m == args.m[0]:  # the same matrix as ours? (else its timing would mean little)
                    want = (x @ w16.t()).float()
                    err = ((int4mm(xb, *tinygemm).float() - want).norm() / want.norm()).item()
                    int4_errors[f"{n}x{k}"] = err
                    notes.append(f"torch_int4 {n}x{k}: relative error against the dequantized fp16 product "
                                 f"{err:.1e}")
                    log(f"# {notes[-1]}")
            launched = time_fns(fns, args.reps, args.inner, dev)
            ms = launched
            if use_graphs:
                try:
                    ms = time_fns(fns, args.reps, args.inner, dev, graphs=True)
                except RuntimeError as e:  # a kernel that cannot be captured: say so, time the launches
                    use_graphs = False
                    notes.append(f"CUDA graph capture failed ({str(e).splitlines()[0][:160]}); "
                                 "the figures from here on are launch-bound times")
                    log(f"# {notes[-1]}")
            for name in ms:
                row = _row(n, k, m, name, ms, bw, args.fp16, args.int8, launched if use_graphs else None)
                rows.append(row)
                log(f"{n:>5} x {k:<5} {m:>4} {name:>12} {row['us']:>9.1f} {row['gbps']:>7.0f} "
                    f"{row['tflops']:>8.1f} {row['speedup']:>8.2f}x {row['roof_us']:>8.1f} {row['pct_roof']:>5.0f}% "
                    f"{'' if row['launched_us'] is None else format(row['launched_us'], '9.1f')}")
    return {"device": device_name, "graphs": use_graphs, "bandwidth_bytes_per_s": bw, "fp16_peak_flops": args.fp16,
            "int8_peak_ops": args.int8, "dtype": args.dtype, "notes": notes,
            "torch_int4_rel_error": int4_errors, "records": rows}


def main(args) -> int:
    result = run(args)
    if result is not None and args.json:
        atomic_write_text(args.json, json.dumps(result, indent=1))
        print(f"# wrote {args.json}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--m", type=int, nargs="+", default=BATCHES, help="batch rows M")
    p.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="N x K, e.g. 4096x4096")
    p.add_argument("--rotate-mb", type=float, default=256,
                   help="each kernel cycles through copies of its weights totalling this much (default "
                        "256 MB, several times an H100's 50 MB L2: M = 1 streams from HBM)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a dry run of this command on the reference / CPU ops (its tests use it)")
    p.add_argument("--bw", type=float, default=None,
                   help="memory bandwidth, bytes/s (default: measured here by a 2 GiB device copy)")
    p.add_argument("--fp16", type=float, default=989e12, help="dense fp16 tensor-core peak, FLOP/s")
    p.add_argument("--int8", type=float, default=1979e12, help="dense int8 tensor-core peak, OP/s")
    p.add_argument("--reps", type=int, default=7, help="A B A B rounds")
    p.add_argument("--inner", type=int, default=20, help="calls per timed round")
    p.add_argument("--no-graphs", action="store_true",
                   help="time calls launched one by one only (default: also replay them from a CUDA graph, "
                        "the GPU's time without the host's launch cost)")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--json", help="write the records to this file")
