#!/usr/bin/env python
"""Quick in-process comparison of the quantizers on one model: perplexity of each stage.

Applies each method to a copy of the model (calibrated on ``--calib``) and scores
perplexity on ``--eval`` with the transformers model itself: int4 layers run their
dequantized weights (exactly what ``w4a16_gemm`` computes); int8 layers are swapped for
a module calling the reference ops (``w8a8_gemm``, ``w8a8_outlier_gemm``), so per-token
activation quantization -- where outliers hurt -- is simulated too. Independent of the
export / runtime / eval packages; ``compress run examples/quantizers.yaml`` is the full path.

  python scripts/eval_quantizers.py --model models/pydoc-llama
  python scripts/eval_quantizers.py --model /tmp/llama-outliers --stages llm-int8 --drop-columns 55 105 [--guard]
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from compress.calibration import load_calibration_ids  # noqa: E402
from compress.io.files import atomic_write_text  # noqa: E402
from compress.model_loading import load_model_for_compression  # noqa: E402
from compress.ops import reference as ref  # noqa: E402
from compress.state import CompressionState, StepContext  # noqa: E402
from quantizers.awq import AWQConfig, apply_awq  # noqa: E402
from quantizers.llm_int8 import LLMInt8Config, apply_llm_int8  # noqa: E402
from compress.ops.reference import w8a8_outlier_gemm_guarded  # noqa: E402
from quantizers.rtn import RTNConfig, apply_rtn  # noqa: E402


def stage_table(group_size: int, threshold: float):
    return {
        "rtn-int4": (apply_rtn, RTNConfig(bits=4, group_size=group_size)),
        "awq-int4": (apply_awq, AWQConfig(group_size=group_size)),
        "rtn-w8a8": (apply_rtn, RTNConfig(bits=8)),
        "llm-int8": (apply_llm_int8, LLMInt8Config(threshold=threshold)),
    }


class RefInt8Linear(nn.Module):
    """Runs a w8a8 / llm_int8 QuantizedWeight through the reference op (per-token int8 x)."""

    def __init__(self, qw, bias, guard: float | None = None):
        super().__init__()
        self.qw, self.bias, self.guard = qw, bias, guard

    def forward(self, x):
        t = self.qw.tensors
        x2 = x.reshape(-1, x.shape[-1])
        if self.qw.scheme == "w8a8":
            y = ref.w8a8_gemm(x2, t["qweight"], t["weight_scale"])
        elif self.guard is not None:
            y = w8a8_outlier_gemm_guarded(x2, t["qweight"], t["weight_scale"], t["outlier_idx"],
                                          t["outlier_weight"], self.guard)
        else:
            y = ref.w8a8_outlier_gemm(x2, t["qweight"], t["weight_scale"], t["outlier_idx"], t["outlier_weight"])
        y = y.reshape(*x.shape[:-1], -1)
        return y + self.bias if self.bias is not None else y


def drop_outlier_columns(qw, columns: list[int]):
    """Forget ``columns`` from the calibrated outlier set (as if calibration had missed
    them): the run-time spike case a static set must survive."""
    t = qw.tensors
    keep = torch.tensor([c not in set(columns) for c in t["outlier_idx"].tolist()], dtype=torch.bool)
    return type(qw)(qw.scheme, {**t, "outlier_idx": t["outlier_idx"][keep],
                                "outlier_weight": t["outlier_weight"][:, keep]}, qw.meta)


def install_int8_ops(state: CompressionState, guard: float | None = None, drop: list[int] = ()) -> None:
    for name, qw in state.quantized.items():
        if qw.scheme == "llm_int8" and drop:
            qw = drop_outlier_columns(qw, drop)
        if qw.scheme in ("w8a8", "llm_int8"):
            mod = state.model.get_submodule(name)
            state.model.set_submodule(name, RefInt8Linear(qw, mod.bias, guard))


@torch.no_grad()
def perplexity(model, stream: torch.Tensor, seq_len: int, batch_size: int = 8) -> float:
    """Non-overlapping ``seq_len`` windows of the whole stream, mean NLL over predicted tokens."""
    windows = [stream[i:i + seq_len] for i in range(0, len(stream), seq_len)]
    windows = [w for w in windows if len(w) > 1]
    nll, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i:i + batch_size]
        if len({len(w) for w in chunk}) > 1:          # ragged tail: score it alone
            for w in chunk:
                logits = model(input_ids=w[None]).logits[0, :-1].float()
                nll += float(nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
                count += len(w) - 1
            continue
        ids = torch.stack(chunk)
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll += float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                 reduction="sum"))
        count += ids[:, 1:].numel()
    return math.exp(nll / count)


@torch.no_grad()
def logprobs(model, windows: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(input_ids=windows[i:i + 8]).logits.float().log_softmax(-1)
                      for i in range(0, len(windows), 8)])


def kl_to_base(base_lp: torch.Tensor, lp: torch.Tensor) -> float:
    """Mean over positions of KL(base || stage) of the next-token distributions."""
    return float((base_lp.exp() * (base_lp - lp)).sum(-1).mean())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--calib", default=str(REPO / "data/pydoc/calib.txt"))
    p.add_argument("--eval", default=str(REPO / "data/pydoc/eval.txt"))
    p.add_argument("--stages", nargs="+", default=["rtn-int4", "awq-int4", "rtn-w8a8", "llm-int8"])
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--threshold", type=float, default=6.0)
    p.add_argument("--max-eval-tokens", type=int, default=0, help="0 = the whole eval file")
    p.add_argument("--guard", action="store_true", help="llm-int8 with the per-token spike guard")
    p.add_argument("--drop-columns", type=int, nargs="*", default=[],
                   help="llm-int8: remove these input columns from every calibrated outlier set (spike test)")
    p.add_argument("--kl-windows", type=int, default=16, help="eval windows used for KL to base")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model, tok, arch, model_dir = load_model_for_compression(args.model)
    stream = torch.tensor(tok(Path(args.eval).read_text(encoding="utf-8")).input_ids)
    if args.max_eval_tokens:
        stream = stream[:args.max_eval_tokens]
    ids = load_calibration_ids([args.calib], tok, args.samples, args.seq_len, 0)
    n_kl = min(args.kl_windows, len(stream) // args.seq_len)
    kl_windows = stream[:n_kl * args.seq_len].reshape(n_kl, args.seq_len)
    base_lp = logprobs(model, kl_windows)
    rows = [{"name": "base", "perplexity": perplexity(model, stream, args.seq_len), "kl_to_base": 0.0}]
    print(f"base: ppl {rows[0]['perplexity']:.4f}", flush=True)
    table = stage_table(args.group_size, args.threshold)
    for name in args.stages:
        apply, cfg = table[name]
        state = CompressionState(copy.deepcopy(model), arch, tok, str(model_dir))
        ctx = StepContext(where=name, calibration=lambda: ids, progress=False)
        t0 = time.perf_counter()
        apply(state, cfg, ctx)
        seconds = time.perf_counter() - t0
        install_int8_ops(state, args.threshold if args.guard else None, args.drop_columns)
        ppl = perplexity(state.model, stream, args.seq_len)
        row = {"name": name, "perplexity": ppl, "kl_to_base": kl_to_base(base_lp, logprobs(state.model, kl_windows)),
               "quantize_s": round(seconds, 1),
               "peak_rss_mb_so_far": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}
        if "llm_int8" in ctx.extras:
            row["outlier_fraction"] = ctx.extras["llm_int8"]["outlier_fraction"]
            row["outlier_columns"] = ctx.extras["llm_int8"]["outlier_columns"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del state
    base = rows[0]["perplexity"]
    print(f"\n{Path(args.model).name}: eval tokens {len(stream)}, calib {args.samples}x{args.seq_len}, "
          f"group {args.group_size}")
    print("| stage | perplexity | gap to base | KL to base (nats/token) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['perplexity']:.4f} | {100 * (r['perplexity'] / base - 1):+.3f}% "
              f"| {r['kl_to_base']:.2e} |")
    if args.json:
        atomic_write_text(args.json, json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
