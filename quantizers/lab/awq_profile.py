#!/usr/bin/env python
"""Where ``method: awq`` spends its time, by part, on one model and calibration set.
Not part of the tests.

  .venv/bin/python quantizers/lab/awq_profile.py --model /tmp/h2-bench/hf \\
      --samples 16 --seq-len 128 --threads 2 [--blocks 4] [--save q.safetensors] \\
      [--compare q.safetensors] [--cprofile prof.out]

Parts are timed by wrapping the functions ``quantizers.awq`` calls (in memory, for this
process only): capturing module inputs, the scale search's pseudo-quantization and its
loss forwards, the clip search, the final int4 quantization, and the block forwards
that carry the calibration set to the next block. ``--save`` writes every recorded
QuantizedWeight's tensors; ``--compare`` reports how far this run's are from a saved run's
(codes that differ, largest scale difference), to check that a speed-up kept the result.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


class PartTimer:
    """Wraps ``module.attr`` so every call adds its wall time to ``times[part]``.
    Nested parts are subtracted from their parent (exclusive time)."""

    def __init__(self):
        self.times: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[list] = []
        self.undo = []

    def timed(self, fn, part: str):
        def timed(*args, **kwargs):
            self.stack.append([part, 0.0])
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - t0
                _, inner = self.stack.pop()
                self.times[part] += total - inner
                self.calls[part] += 1
                if self.stack:
                    self.stack[-1][1] += total
        return timed

    def wrap(self, module, attr: str, part: str) -> None:
        original = getattr(module, attr)
        setattr(module, attr, self.timed(original, part))
        self.undo.append((module, attr, original))

    def wrap_callback(self, module, attr: str, arg: int, part: str) -> None:
        """Time the callable passed as positional argument ``arg`` of ``module.attr``."""
        original = getattr(module, attr)

        def with_timed_callback(*args, **kwargs):
            args = list(args)
            args[arg] = self.timed(args[arg], part)
            return original(*args, **kwargs)

        setattr(module, attr, with_timed_callback)
        self.undo.append((module, attr, original))

    def restore(self) -> None:
        for module, attr, original in reversed(self.undo):
            setattr(module, attr, original)
        self.undo.clear()


def instrument(timer: PartTimer) -> None:
    """Wrap whichever of these the code in hand has (older and newer versions differ)."""
    import compress.calibration as calibration
    from quantizers import awq, awq_search

    parts = [
        (calibration, "run_block", "block forwards (carry calibration on)"),
        (calibration, "capture_first_block_inputs", "embedding forward"),
        (awq, "capture_inputs", "capture inputs (block forward + hooks)"),
        (awq, "capture_inputs_outputs", "capture inputs (block forward + hooks)"),
        (awq, "_mean_abs", "activation scales"),
        (awq, "_linear_loss", "scale search: Gram setup"),
        (awq, "search_scale", "scale search: other"),
        (awq_search, "fake_quantize_int4", "scale search: pseudo-quantize"),
        (awq_search, "fake_quantize_int4_scaled", "scale search: pseudo-quantize"),
        (awq, "search_clip", "clip search"),
        (awq, "_token_sample", "clip token sample"),
        (awq.primitives, "quantize_int4_groupwise", "int4 quantize"),
        (awq, "int4_quantized_weight", "pack/record"),
    ]
    for module, attr, part in parts:
        if hasattr(module, attr):
            timer.wrap(module, attr, part)
    timer.wrap_callback(awq, "search_scale", 2, "scale search: loss forwards")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="/tmp/h2-bench/hf")
    p.add_argument("--calib", default=str(REPO / "data/pydoc/calib.txt"))
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--blocks", type=int, default=0, help="quantize only the first N blocks (0 = all)")
    p.add_argument("--save", help="write the quantized tensors here (safetensors)")
    p.add_argument("--compare", help="compare with tensors saved by --save")
    p.add_argument("--cprofile", help="also write a cProfile dump here")
    p.add_argument("--eval", help="also print the perplexity of the base and the AWQ model on this text file")
    p.add_argument("--eval-tokens", type=int, default=0, help="first N tokens of --eval (0 = all)")
    p.add_argument("--per-layer", action="store_true", help="with --compare: the share of differing codes per layer")
    args = p.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from compress.calibration import load_calibration_ids
    from compress.model_loading import load_model_for_compression
    from compress.state import CompressionState, StepContext
    from quantizers.awq import AWQConfig, apply_awq

    torch.set_num_threads(args.threads)
    model, tok, arch, model_dir = load_model_for_compression(args.model)
    calib = load_calibration_ids([args.calib], tok, args.samples, args.seq_len, 0)
    targets = ["re:.*layers\\.\\d+\\..*"] if not args.blocks else \
        [f"re:.*layers\\.({'|'.join(str(i) for i in range(args.blocks))})\\..*"]
    config = AWQConfig(group_size=args.group_size, targets=targets)
    base_ppl = None
    if args.eval:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from awq_vs_llmcompressor import perplexity

        stream = torch.tensor(tok(Path(args.eval).read_text(encoding="utf-8")).input_ids)
        stream = stream[:args.eval_tokens] if args.eval_tokens else stream
        base_ppl = perplexity(model, stream)
    state = CompressionState(model, arch, tok, str(model_dir))
    ctx = StepContext("profile", lambda: calib, progress=False)
    n_params = sum(p.numel() for p in model.parameters())

    timer = PartTimer()
    instrument(timer)
    import quantizers.awq as awq_module

    grid_losses: list[list[float]] = []          # each scale search's losses, in call order
    searched = awq_module.search_scale

    def recording_search(*a, **k):
        result = searched(*a, **k)
        grid_losses.append([float(v) for v in result[2]])
        return result
    awq_module.search_scale = recording_search
    prof = cProfile.Profile() if args.cprofile else None
    load = os.getloadavg()
    t0, c0 = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    apply_awq(state, config, ctx)
    if prof:
        prof.disable()
        prof.dump_stats(args.cprofile)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    timer.restore()
    awq_module.search_scale = searched

    print(f"{model_dir}: {n_params / 1e6:.0f}M params, calib {args.samples}x{args.seq_len}, "
          f"group {args.group_size}, threads {torch.get_num_threads()}, "
          f"blocks {args.blocks or 'all'}; load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print("| part | s | calls | share |\n|---|---|---|---|")
    for part, s in sorted(timer.times.items(), key=lambda kv: -kv[1]):
        print(f"| {part} | {s:.2f} | {timer.calls[part]} | {100 * s / wall:.1f}% |")
    print(f"| unattributed (reference forwards, folding, Python) | {wall - sum(timer.times.values()):.2f} | | |")
    print(f"| **AWQ wall** | {wall:.2f} | | |")
    print(f"process CPU s: {cpu:.1f} ({cpu / wall:.2f} cores busy on average)")
    print(f"s per billion params: {wall / (n_params / 1e9):.0f}")

    if base_ppl is not None:
        ppl = perplexity(state.model, stream)
        print(f"perplexity on {len(stream)} tokens of {args.eval}: base {base_ppl:.4f}, AWQ {ppl:.4f} "
              f"({100 * (ppl / base_ppl - 1):+.3f}%)")

    tensors = {f"{name}.{k}": v.contiguous() for name, qw in state.quantized.items() for k, v in qw.tensors.items()}
    alphas = ctx.stats.get("awq", {}).get("alpha", {})
    if args.save:
        from safetensors.torch import save_file

        tmp = args.save + ".tmp"
        save_file(tensors, tmp, metadata={"alpha": json.dumps(alphas), "losses": json.dumps(grid_losses)})
        os.replace(tmp, args.save)
    if args.compare:
        from compress.ops.reference import unpack_int4
        from safetensors.torch import load_file

        from safetensors import safe_open

        ref = load_file(args.compare)
        with safe_open(args.compare, "pt") as f:
            ref_alphas = json.loads((f.metadata() or {}).get("alpha", "{}"))
            ref_losses = json.loads((f.metadata() or {}).get("losses", "[]"))
        names = list(alphas)
        for i, name in enumerate(names):
            if name in ref_alphas and ref_alphas[name] != alphas[name]:
                line = f"alpha of {name}: {ref_alphas[name]} -> {alphas[name]}"
                if i < min(len(ref_losses), len(grid_losses)):
                    n_grid = len(grid_losses[i])
                    a, b = round(ref_alphas[name] * n_grid), round(alphas[name] * n_grid)
                    old_l, new_l = ref_losses[i], grid_losses[i]
                    line += (f"; reference run's losses there {old_l[a]:.6g} vs {old_l[b]:.6g} "
                             f"({100 * (old_l[b] / old_l[a] - 1):+.3f}%), this run's {new_l[a]:.6g} vs "
                             f"{new_l[b]:.6g} ({100 * (new_l[b] / new_l[a] - 1):+.3f}%); RTN (alpha 0) "
                             f"{old_l[0]:.6g} / {new_l[0]:.6g}")
                print(line)
        differing, total, scale_diff, zero_diff = 0, 0, 0.0, 0
        for key, t in tensors.items():
            r = ref[key]
            if key.endswith("qweight"):
                a, b = unpack_int4(t), unpack_int4(r)
                differing += int((a != b).sum())
                total += a.numel()
                if args.per_layer:
                    print(f"  {key[:-len('.qweight')]}: {100 * float((a != b).float().mean()):.4f}% codes differ")
            elif key.endswith("scales"):
                scale_diff = max(scale_diff, float(((t - r).abs() / r.abs().clamp_min(1e-12)).max()))
            elif key.endswith("zeros"):
                zero_diff += int((t != r).sum())
        print(f"vs {args.compare}: int4 codes differing {differing}/{total} ({100 * differing / max(total, 1):.4f}%), "
              f"zero points differing {zero_diff}, largest relative scale difference {scale_diff:.2e}")


if __name__ == "__main__":
    main()
