#!/usr/bin/env python
"""Our AWQ vs llm-compressor's AWQModifier on the same model, calibration windows and
group size, on the CPU; prints both perplexities side by side. Not part of the tests.

llm-compressor pulls another transformers, so it lives in its own venv:

  python -m venv /tmp/llmc-venv
  /tmp/llmc-venv/bin/pip install llmcompressor torch==2.13.0     # pin: keeps the CPU torch

  .venv/bin/python quantizers/lab/awq_vs_llmcompressor.py --model models/pydoc-llama \\
      --llmc-python /tmp/llmc-venv/bin/python
  # the 345M bench model (compress bench make-model --out /tmp/h2-bench), 16 x 128 tokens, 2 threads:
  .venv/bin/python quantizers/lab/awq_vs_llmcompressor.py --model /tmp/h2-bench/hf --samples 16 \\
      --seq-len 128 --threads 2 --max-eval-tokens 4096

How: this process (our venv) tokenizes the calibration windows (``load_calibration_ids``,
the recipe's sampler) and the eval stream once and saves them (safetensors); a worker process in the
llm-compressor venv runs ``oneshot`` with ``AWQModifier()`` + ``QuantizationModifier(scheme="W4A16_ASYM")`` on exactly
those ids and scores the fake-quantized model on the same eval ids; then we run our
``apply_awq`` (asymmetric int4, same group size) and score it the same way.

CPU patch (worker only, applied in memory, nothing on disk changed): before each AWQ
mapping's grid search, llm-compressor pins its cached calibration activations
(``IntermediatesCache.pin_memory`` -> ``Tensor.pin_memory()``), which needs an
accelerator; we make ``IntermediatesCache.pin_memory`` a no-op while it runs.
Everything else (mappings, duo scaling, its 20-point grid, calibration batch size 1) is
llm-compressor's default; its AWQ has no clip search, ours does (``clip: true``, the default).
Under GQA llm-compressor skips the v_proj -> o_proj mapping; ours searches it.

Both AWQ times are wall seconds of the whole call (calibration forwards included, model
loading and scoring not), printed with the load average around each run (other processes
on the machine slow either side) and the process CPU seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


@torch.no_grad()
def perplexity(model, stream: torch.Tensor, seq_len: int = 256, batch_size: int = 8) -> float:
    """Non-overlapping windows; the ragged tail window is scored alone."""
    windows = [stream[i:i + seq_len] for i in range(0, len(stream), seq_len)]
    windows = [w for w in windows if len(w) > 1]
    nll, count = 0.0, 0
    full = [w for w in windows if len(w) == seq_len]
    for i in range(0, len(full), batch_size):
        ids = torch.stack(full[i:i + batch_size])
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       ids[:, 1:].reshape(-1), reduction="sum"))
        count += ids[:, 1:].numel()
    for w in windows:
        if len(w) != seq_len:
            logits = model(input_ids=w[None]).logits[0, :-1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            count += len(w) - 1
    return math.exp(nll / count)


# ---------------------------------------------------------------- llm-compressor side
def worker(args) -> None:
    """Runs inside the llm-compressor venv."""
    torch.set_num_threads(args.threads)
    from safetensors.torch import load_file

    data = load_file(args.data)
    calib, stream = data["calib"], data["eval"]

    from llmcompressor.pipelines.cache import IntermediatesCache

    pinned = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, *a, **k: None    # CPU: nothing to pin into
    try:
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.transform.awq import AWQModifier
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        ds = Dataset.from_dict({"input_ids": calib.tolist(),
                                "attention_mask": torch.ones_like(calib).tolist()})
        from llmcompressor.modifiers.quantization import QuantizationModifier

        if args.group_size == 128:
            quant = QuantizationModifier(ignore=["lm_head"], scheme="W4A16_ASYM", targets=["Linear"])
        else:
            quant = QuantizationModifier(ignore=["lm_head"], config_groups={"group_0": {
                "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                   "strategy": "group", "group_size": args.group_size}}})
        recipe = [AWQModifier(), quant]          # llm-compressor's own defaults otherwise
        load = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=calib.shape[1],
                num_calibration_samples=calib.shape[0], batch_size=args.llmc_batch_size)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        loads = [load, os.getloadavg()[0]]
    finally:
        IntermediatesCache.pin_memory = pinned
    model.eval()
    # compressed-tensors fake-quantizes each weight in forward while its status is below COMPRESSED
    fake_quant = [n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None
                  and str(getattr(m, "quantization_status", "")) in ("frozen", "QuantizationStatus.FROZEN")]
    ppl = perplexity(model, stream)
    Path(args.result).write_text(json.dumps({"perplexity": ppl, "seconds": seconds, "cpu_seconds": cpu,
                                             "load": loads, "threads": torch.get_num_threads(),
                                             "fake_quantized_linears": len(fake_quant)}))


# ------------------------------------------------------------------------ our side
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO / "models/pydoc-llama"))
    p.add_argument("--calib", default=str(REPO / "data/pydoc/calib.txt"))
    p.add_argument("--eval", default=str(REPO / "data/pydoc/eval.txt"))
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--max-eval-tokens", type=int, default=0, help="0 = the whole eval file")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--llmc-batch-size", type=int, default=1, help="llm-compressor's calibration batch size "
                   "(its default: 1); ours runs batches of AWQConfig.batch_size (8)")
    p.add_argument("--ours-first", action="store_true", help="run our AWQ before llm-compressor's")
    p.add_argument("--llmc-python", default="/tmp/llmc-venv/bin/python")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    sys.path.insert(0, str(REPO))
    import copy

    from compress.calibration import load_calibration_ids
    from compress.model_loading import load_model_for_compression
    from compress.state import CompressionState, StepContext
    from quantizers.awq import AWQConfig, apply_awq

    torch.set_num_threads(args.threads)
    model, tok, arch, model_dir = load_model_for_compression(args.model)
    calib = load_calibration_ids([args.calib], tok, args.samples, args.seq_len, 0)
    stream = torch.tensor(tok(Path(args.eval).read_text(encoding="utf-8")).input_ids)
    if args.max_eval_tokens:
        stream = stream[:args.max_eval_tokens]
    n_params = sum(p.numel() for p in model.parameters())

    def run_ours():
        state = CompressionState(copy.deepcopy(model), arch, tok, str(model_dir))
        load = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        apply_awq(state, AWQConfig(group_size=args.group_size), StepContext("bench", lambda: calib, progress=False))
        result = {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
                  "load": [load, os.getloadavg()[0]], "threads": torch.get_num_threads()}
        result["perplexity"] = perplexity(state.model, stream)
        return result

    def run_llmc():
        with tempfile.TemporaryDirectory() as tmp:
            from safetensors.torch import save_file

            data, result = Path(tmp) / "ids.safetensors", Path(tmp) / "llmc.json"
            save_file({"calib": calib.contiguous(), "eval": stream.contiguous()}, str(data))
            cmd = [args.llmc_python, __file__, "--worker", "--model", str(model_dir), "--data", str(data),
                   "--result", str(result), "--group-size", str(args.group_size), "--threads", str(args.threads),
                   "--llmc-batch-size", str(args.llmc_batch_size)]
            print("llm-compressor:", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            return json.loads(result.read_text())

    if args.ours_first:
        ours = run_ours()
        llmc = run_llmc()
    else:
        llmc = run_llmc()
        ours = run_ours()
    base = perplexity(model, stream)

    def row(name, r):
        return (f"| {name} | {r['perplexity']:.4f} | {100 * (r['perplexity'] / base - 1):+.2f}% | {r['seconds']:.1f} "
                f"| {r['seconds'] / (n_params / 1e9):.0f} | {r['cpu_seconds']:.0f} | {r['threads']} "
                f"| {r['load'][0]:.1f} -> {r['load'][1]:.1f} |")

    print(f"\n{model_dir.name} ({n_params / 1e6:.0f}M params): calib {args.samples}x{args.seq_len}, "
          f"int4 asymmetric group {args.group_size}, eval tokens {len(stream)}, "
          f"llm-compressor batch {args.llmc_batch_size}, ours batch {AWQConfig().batch_size}")
    print(f"(llm-compressor: {llmc['fake_quantized_linears']} linears fake-quantized in forward)")
    print("| model | perplexity | gap to base | AWQ wall s | s per B params | CPU s | threads | load avg |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| base | {base:.4f} | | | | | | |")
    print(row("llm-compressor AWQ", llmc))
    print(row("compress awq", ours))


if __name__ == "__main__":
    main()
