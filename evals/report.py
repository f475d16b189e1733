"""The side-by-side report of every stage: ``report.json`` and ``report.md``.

A stage record is a plain dict: ``name, path, parameters, size_bytes, bits_per_weight,
perplexity, kl_to_base, top1_agreement, tasks {task: {metric: value}}, prefill_tok_s,
decode_tok_s`` plus anything extra (kept in the JSON; ``speculative``: the stage's figures
as a speculative draft of the base, ``evals/speculative.py``, in a table of its own). The
first record is the unmodified model, ``base``. Both files are written atomically
(temporary file, then rename); the plots (``evals/report_plots.py``: perplexity and decode
speed against size, Pareto front highlighted) are PNGs beside them, linked from
``report.md``, or a note says why not.
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

import torch

from compress.io.files import atomic_write_text

COLUMNS = [  # (key, header, format, the cell of the record's "errors" that fills it)
    ("parameters", "parameters", "count", "size"),
    ("size_bytes", "size", "size", "size"),
    ("bits_per_weight", "bits/weight", "{:.2f}", "size"),
    ("perplexity", "perplexity", "{:.3f}", "perplexity"),
    ("kl_to_base", "KL to base (nats)", "small", "kl"),
    ("top1_agreement", "top-1 agree", "{:.2%}", "kl"),
    ("prefill_tok_s", "prefill tok/s", "{:,.0f}", "speed"),
    ("decode_tok_s", "decode tok/s", "{:,.1f}", "speed"),
    ("w4_activations", "int4 activations", "{}", "load"),
]
ERROR_CELL = "error"

COLUMN_NOTES = {
    "parameters": "parameters of the stage's model (a quantized linear counts its logical "
                  "out x in weights; a tied embedding once): a pruned stage has fewer",
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
    "int4 activations": "what the runtime's int4 layers ran with for every figure of the row: float "
                        "(the w4a16 scheme's numbers) or int8 per block of 32 (the CPU fast path); "
                        "— for a stage without int4 layers",
}

PREFERRED_METRICS = ("acc", "acc_norm", "word_perplexity", "byte_perplexity", "bits_per_byte",
                     "exact_match")


def _fmt(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if fmt == "size":
        return human_bytes(value)
    if fmt == "count":
        return human_count(value)
    if fmt == "small":   # 5 decimals, but a positive value too small for them keeps its digits (never 0.00000)
        return f"{value:.2e}" if 0 < abs(value) < 5e-6 else f"{value:.5f}"
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


def human_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


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


def _failed(stage: dict, cell: str) -> bool:
    errors = stage.get("errors") or {}
    return cell in errors or (cell != "size" and "load" in errors)


def _error_message(error) -> str:
    return error.get("message", "") if isinstance(error, dict) else str(error)


def _settings_line(stages: list[dict]) -> str | None:
    """The context-dependent settings the first evaluated stage ran with."""
    s = next((s for s in stages if s.get("eval_settings")), None)
    if s is None:
        return None
    parts, cfg = [], s["eval_settings"]
    if cfg.get("perplexity"):
        p = cfg["perplexity"]
        parts.append(f"perplexity windows of {p['seq_len']} tokens, stride {p['stride']}")
    if cfg.get("kl"):
        parts.append(f"KL over {cfg['kl']['windows']} windows of {cfg['kl']['seq_len']} tokens")
    if cfg.get("speed"):
        parts.append(f"speed: {cfg['speed']['prompt_len']}-token prompt, {cfg['speed']['new_tokens']} new tokens")
    context = f" (model context: {s['context']} tokens)" if s.get("context") else ""
    return "; ".join(parts) + context + "." if parts else None


def _plots_section(plots) -> list[str]:
    """Links to the PNGs written beside report.md, and why any is missing."""
    if plots is None:
        return []
    lines = ["", "## Plots", ""]
    lines += [f"![{title}]({file})" + "\n" for file, title in plots.written]
    if plots.written:
        lines += ["Pareto front (red): the stages that no other stage beats on both size and the figure.", ""]
    lines += [f"- {note}" for note in plots.notes]
    return lines


SPECULATIVE_COLUMNS = [  # (key of rec["speculative"], header, format)
    ("k", "k", "{}"),
    ("alpha", "α per token", "{:.3f}"),
    ("tokens_per_pass", "tokens / verify", "{:.2f}"),
    ("target_tok_s", "base alone tok/s", "{:,.1f}"),
    ("spec_tok_s", "with draft tok/s", "{:,.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
]


def _speculative_section(stages: list[dict]) -> list[str]:
    """The table of the stages measured as speculative drafts of the base (records with
    ``speculative``, or an error in that cell); no lines when there are none."""
    drafts = [s for s in stages if s.get("speculative") or "speculative" in (s.get("errors") or {})]
    if not drafts:
        return []
    target = stages[0].get("name", "base") if stages else "base"
    lines = ["", f"## Speculative decoding (drafts of {target})", ""]
    first = next((s["speculative"] for s in drafts if s.get("speculative")), None)
    if first:
        lines += [f"Each stage as a draft of `{target}`: batch 1, greedy, {first.get('prompts')} prompts of "
                  f"{first.get('prompt_len')} tokens of the eval text, {first.get('new_tokens')} new tokens each; "
                  f"tok/s are decode medians over {first.get('rounds')} rounds alternating the target alone and "
                  "with the draft, speedup the median of the rounds' ratios. α: accepted draft tokens / (accepted "
                  "+ verify passes that rejected one); tokens / verify: tokens appended per verify pass. The "
                  "outputs with a draft must be identical to the target's alone.", ""]
    head = ["draft"] + [h for _, h, _ in SPECULATIVE_COLUMNS] + ["identical"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in drafts:
        r = s.get("speculative")
        if not r:
            cells = [ERROR_CELL] * (len(head) - 1)
        else:
            cells = [_fmt(r.get(k), f) for k, _, f in SPECULATIVE_COLUMNS]
            cells.append("yes" if r.get("identical") else ERROR_CELL)
        lines.append("| " + " | ".join([f"`{s.get('name', '?')}`"] + cells) + " |")
    return lines


def render_markdown(stages: list[dict], title: str = "compress report",
                    machine: dict | None = None, plots=None) -> str:
    """``plots``: the :class:`evals.report_plots.PlotResult` of the PNGs beside the report."""
    lines = [f"# {title}", ""]
    head = ["stage"] + [h for _, h, _, _ in COLUMNS]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in stages:
        cells = [f"`{s.get('name', '?')}`"] + [
            ERROR_CELL if s.get(k) is None and _failed(s, cell) else _fmt(s.get(k), f)
            for k, _, f, cell in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _plots_section(plots)
    tm = _task_metrics(stages)
    failed_tasks = sorted({c.partition(".")[2] for s in stages for c in (s.get("errors") or {})
                           if c.startswith("tasks.")} - {t for t, _ in tm})
    tm += [(t, "—") for t in failed_tasks]
    if tm:
        lines += ["", "## Tasks (lm-eval)", ""]
        head = ["task", "metric"] + [s.get("name", "?") for s in stages]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for task, metric in tm:
            cells = [task, metric]
            for s in stages:
                row = (s.get("tasks") or {}).get(task, {})
                v, err = row.get(metric), row.get(f"{metric}_stderr")
                if v is None and _failed(s, f"tasks.{task}"):
                    cells.append(ERROR_CELL)
                    continue
                cell = _fmt(v, "{:.4f}")
                if isinstance(err, (int, float)) and not math.isnan(err) and v is not None:
                    cell += f" ± {err:.4f}"
                cells.append(cell)
            lines.append("| " + " | ".join(cells) + " |")
    lines += _speculative_section(stages)
    errors = [(s.get("name", "?"), cell, _error_message(e)) for s in stages
              for cell, e in (s.get("errors") or {}).items()]
    if errors:
        lines += ["", "## Errors", "", "Cells marked `error` could not be measured (tracebacks "
                  "in report.json); every other cell was.", ""]
        lines += [f"- `{n}` {cell}: {msg}" for n, cell, msg in errors]
    paths = [(s.get("name"), s.get("path")) for s in stages if s.get("path")]
    if paths:
        lines += ["", "## Checkpoints", ""] + [f"- `{n}`: `{p}`" for n, p in paths]
    lines += ["", "## Columns", ""] + [f"- **{k}**: {v}" for k, v in COLUMN_NOTES.items()]
    lines.append("- **tasks**: lm-eval scores through the `compress` model over our runtime "
                 "(acc: higher is better; perplexities and bits_per_byte: lower is better)")
    settings = _settings_line(stages)
    if settings:
        lines += ["", f"Settings: {settings}"]
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
    """Write ``report.json``, ``report.md`` and the plots into ``out_dir``; returns the
    paths of the JSON and the markdown."""
    if not stages:
        raise ValueError("a report needs at least one stage record")
    if stages[0].get("name") != "base":
        raise ValueError(f"the first stage record must be 'base', got {stages[0].get('name')!r}")
    out = Path(out_dir)
    machine = machine or machine_info()
    json_path, md_path = out / "report.json", out / "report.md"
    payload = {"stages": _jsonable(stages), "machine": machine}
    atomic_write_text(json_path, json.dumps(payload, indent=2) + "\n")
    from evals.report_plots import write_plots

    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(stages, out)
    atomic_write_text(md_path, render_markdown(stages, title, machine, plots))
    return json_path, md_path
