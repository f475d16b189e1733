"""The side-by-side report of every stage: ``report.json`` and ``report.md``.

A stage record is a plain dict: ``name, path, size_bytes, bits_per_weight, perplexity,
kl_to_base, top1_agreement, tasks {task: {metric: value}}, prefill_tok_s, decode_tok_s``
plus anything extra (kept in the JSON). The first record is the unmodified model, ``base``.
Both files are written atomically (temporary file, then rename).
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

import torch

from compress.io.files import atomic_write_text

COLUMNS = [  # (key, header, format)
    ("size_bytes", "size", "size"),
    ("bits_per_weight", "bits/weight", "{:.2f}"),
    ("perplexity", "perplexity", "{:.3f}"),
    ("kl_to_base", "KL to base (nats)", "{:.5f}"),
    ("top1_agreement", "top-1 agree", "{:.2%}"),
    ("prefill_tok_s", "prefill tok/s", "{:,.0f}"),
    ("decode_tok_s", "decode tok/s", "{:,.1f}"),
]

COLUMN_NOTES = {
    "size": "bytes on disk of the stage's checkpoint weights (safetensors files)",
    "bits/weight": "stored bits per parameter of the quantizable linear weights, scales and "
                   "zero points included (16/32 = unquantized)",
    "perplexity": "rolling-window perplexity of the held-out text (only new tokens of each "
                  "window scored); lower is better",
    "KL to base (nats)": "mean KL(base || stage) of next-token distributions over fixed "
                         "windows of the held-out text; catches damage perplexity averages away",
    "top-1 agree": "share of those positions where the stage's most likely token is the base's",
    "prefill tok/s": "prompt tokens per second, batch 1 (median of repeats)",
    "decode tok/s": "generated tokens per second after the first, batch 1, greedy (median)",
}

PREFERRED_METRICS = ("acc", "acc_norm", "word_perplexity", "byte_perplexity", "bits_per_byte",
                     "exact_match")


def _fmt(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if fmt == "size":
        return human_bytes(value)
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def machine_info(threads: int | None = None) -> dict:
    return {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "system": f"{platform.system()} {platform.release()}", "cpus": os.cpu_count(),
            "threads": threads or torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}


def _task_metrics(stages: list[dict]) -> list[tuple[str, str]]:
    seen: dict[tuple[str, str], None] = {}
    for s in stages:
        for task, metrics in (s.get("tasks") or {}).items():
            for m in metrics:
                if not m.endswith("_stderr"):
                    seen[(task, m)] = None
    order = {m: i for i, m in enumerate(PREFERRED_METRICS)}
    return sorted(seen, key=lambda tm: (tm[0], order.get(tm[1], len(order)), tm[1]))


def render_markdown(stages: list[dict], title: str = "compress report",
                    machine: dict | None = None) -> str:
    lines = [f"# {title}", ""]
    head = ["stage"] + [h for _, h, _ in COLUMNS]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in stages:
        cells = [f"`{s.get('name', '?')}`"] + [_fmt(s.get(k), f) for k, _, f in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    tm = _task_metrics(stages)
    if tm:
        lines += ["", "## Tasks (lm-eval)", ""]
        head = ["task", "metric"] + [s.get("name", "?") for s in stages]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for task, metric in tm:
            cells = [task, metric]
            for s in stages:
                row = (s.get("tasks") or {}).get(task, {})
                v, err = row.get(metric), row.get(f"{metric}_stderr")
                cell = _fmt(v, "{:.4f}")
                if isinstance(err, (int, float)) and not math.isnan(err) and v is not None:
                    cell += f" ± {err:.4f}"
                cells.append(cell)
            lines.append("| " + " | ".join(cells) + " |")
    paths = [(s.get("name"), s.get("path")) for s in stages if s.get("path")]
    if paths:
        lines += ["", "## Checkpoints", ""] + [f"- `{n}`: `{p}`" for n, p in paths]
    lines += ["", "## Columns", ""] + [f"- **{k}**: {v}" for k, v in COLUMN_NOTES.items()]
    lines.append("- **tasks**: lm-eval scores through the `compress` model over our runtime "
                 "(acc: higher is better; perplexities and bits_per_byte: lower is better)")
    m = machine or machine_info()
    lines += ["", "## Machine", "",
              f"{m.get('processor')} ({m.get('machine')}), {m.get('cpus')} CPUs, "
              f"{m.get('threads')} threads, {m.get('system')}, torch {m.get('torch')}, "
              f"Python {m.get('python')}. Speeds are medians on a shared machine: compare "
              "ratios within one report, not figures across machines.", ""]
    return "\n".join(lines)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x


def write_report(stages: list[dict], out_dir: str | Path, title: str = "compress report",
                 machine: dict | None = None) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.md`` into ``out_dir``; returns their paths."""
    if not stages:
        raise ValueError("a report needs at least one stage record")
    if stages[0].get("name") != "base":
        raise ValueError(f"the first stage record must be 'base', got {stages[0].get('name')!r}")
    out = Path(out_dir)
    machine = machine or machine_info()
    json_path, md_path = out / "report.json", out / "report.md"
    payload = {"stages": _jsonable(stages), "machine": machine}
    atomic_write_text(json_path, json.dumps(payload, indent=2) + "\n")
    atomic_write_text(md_path, render_markdown(stages, title, machine))
    return json_path, md_path
