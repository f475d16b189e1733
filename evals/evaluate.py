"""Evaluate one checkpoint: perplexity, KL to base, lm-eval tasks, speed, size.

``evaluate_checkpoint(path, eval_config, base_logits_cache)`` returns one stage record for
:func:`evals.report.write_report`. ``base_logits_cache`` carries the base model's KL
reference between calls:

* ``None``: this checkpoint is its own reference (KL 0, agreement 1);
* a ``dict``: filled with the reference (key ``"reference"``) on the first call, used on
  later ones: pass the same dict for base, then each stage;
* a :class:`evals.kl.KLReference` (or the path of one saved with ``.save``).

Each measurement is one cell of the report. A cell that fails (a setting the model
cannot take, a task that errors, a bug) is recorded in the record's ``errors``
(``{cell: {"message", "traceback"}}``) and logged; the other cells are still measured.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from compress.config import ConfigError
from evals.backend import load_llm, model_context
from evals.eval_config import SECTIONS, EvalConfig, KLConfig, sized_section
from evals.kl import KLReference, build_kl_reference, kl_to_reference
from evals.perplexity import perplexity

log = logging.getLogger(__name__)


class _Cells:
    """Runs each measurement of one record; a failure becomes ``record["errors"][cell]``."""

    def __init__(self, record: dict):
        self.record = record
        self.errors: dict = record.setdefault("errors", {})

    def run(self, cell: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, or None after recording its exception under ``cell``."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # one failed cell must not lose the report's other cells
            message = f"{type(exc).__name__}: {exc}"
            self.errors[cell] = {"message": message, "traceback": traceback.format_exc()}
            log.warning("%s: %s failed: %s", self.record.get("name"), cell, message)
            return None


def _reference(cache, llm, cfg: KLConfig, progress: bool) -> tuple[KLReference, bool]:
    """(reference, whether it was built from this model)."""
    if isinstance(cache, KLReference):
        return cache, False
    if isinstance(cache, (str, Path)):
        return KLReference.load(cache), False
    if isinstance(cache, dict) and isinstance(cache.get("reference"), KLReference):
        return cache["reference"], False
    if isinstance(cache, dict) and "failed" in cache:
        raise RuntimeError(f"no KL reference: the base's failed ({cache['failed']})")
    ref = build_kl_reference(llm, cfg.file, windows=cfg.windows, seq_len=cfg.seq_len,
                             top_k=cfg.top_k, batch_size=cfg.batch_size, progress=progress)
    if isinstance(cache, dict):
        cache["reference"] = ref
    return ref, True


def size_fields(path: str | Path) -> dict:
    """Parameters, size on disk and bits per weight, as ``compress inspect`` reports them."""
    from compress.io.inspect import inspect_checkpoint

    info = inspect_checkpoint(path, verify=False)
    return {"parameters": info["parameter_count"], "size_bytes": info["weights_bytes"], "bits_per_weight": info["bits_per_weight"],
            "bits_per_weight_overall": info["bits_per_weight_overall"]}


def _perplexity(llm, cfg: EvalConfig, context: int) -> dict:
    pc = sized_section(cfg, "perplexity", context)
    r = perplexity(llm, pc.file, seq_len=pc.seq_len, stride=pc.stride, max_tokens=pc.max_tokens,
                   batch_size=pc.batch_size, progress=cfg.progress)
    return {"perplexity": r.perplexity, "perplexity_tokens": r.tokens, "nll": r.nll}


def _kl(llm, cfg: EvalConfig, context: int, cache) -> dict:
    kc = sized_section(cfg, "kl", context)
    ref, own = _reference(cache, llm, kc, cfg.progress)
    if own:
        return {"kl_to_base": 0.0, "top1_agreement": 1.0, "kl_tokens": ref.tokens}
    k = kl_to_reference(llm, ref, batch_size=kc.batch_size, progress=cfg.progress)
    return {"kl_to_base": k.kl, "top1_agreement": k.top1_agreement, "kl_tokens": k.tokens}


def _speed(llm, cfg: EvalConfig, context: int) -> dict:
    from evals.speed import measure_speed

    sc = sized_section(cfg, "speed", context)
    s = measure_speed(llm, prompt_len=sc.prompt_len, new_tokens=sc.new_tokens,
                      repeats=sc.repeats, warmup=sc.warmup)
    return {"prefill_tok_s": s.prefill_tok_s, "decode_tok_s": s.decode_tok_s, "speed": s.to_dict()}


def _tasks(cells: _Cells, path: Path, llm, cfg: EvalConfig) -> dict:
    """All tasks in one lm-eval run; if that fails, each task alone, so that one failing
    task costs only its own cells."""
    from evals.harness import run_lm_eval

    def run(tasks):
        return run_lm_eval(path, tasks, limit=cfg.task_limit, batch_size=cfg.task_batch_size, llm=llm)

    if len(cfg.tasks) > 1:
        try:
            return run(cfg.tasks)
        except Exception as exc:  # noqa: BLE001  (isolated below, task by task)
            log.warning("lm-eval failed on %s (%s: %s); running each task alone",
                        ", ".join(cfg.tasks), type(exc).__name__, exc)
    scores = {}
    for task in cfg.tasks:
        scores.update(cells.run(f"tasks.{task}", run, [task]) or {})
    return scores


def _settings(cfg: EvalConfig, context: int) -> dict:
    """The sections' settings sized to the context (a section that cannot be sized is left
    out here; its cell records why)."""
    out = {}
    for name in SECTIONS:
        section = getattr(cfg, name)
        try:
            out[name] = asdict(sized_section(cfg, name, context)) if section is not None else None
        except ConfigError:
            out[name] = None
    return out


def evaluate_checkpoint(path: str | Path, eval_config: dict | EvalConfig | None = None,
                        base_logits_cache=None, name: str | None = None, llm=None) -> dict:
    """One stage record (see :mod:`evals.report`) for the checkpoint at ``path``."""
    cfg = EvalConfig.from_dict(eval_config)
    path = Path(path)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    rec: dict = {"name": name or path.name, "path": str(path), "tasks": {}}
    cells = _Cells(rec)
    rec.update(cells.run("size", size_fields, path) or {})
    t0 = time.perf_counter()
    if llm is None:
        llm = cells.run("load", load_llm, path, dtype=cfg.dtype, kernels=cfg.kernels, threads=cfg.threads,
                        w4_activations=cfg.w4_activations)
    if llm is not None:
        rec["w4_activations"] = getattr(llm, "w4_activations", None)  # what its int4 layers ran with
        context = model_context(llm, path)
        rec["context"] = context
        rec["eval_settings"] = _settings(cfg, context)
        if cfg.perplexity:
            rec.update(cells.run("perplexity", _perplexity, llm, cfg, context) or {})
        if cfg.kl:
            rec.update(cells.run("kl", _kl, llm, cfg, context, base_logits_cache) or {})
        if cfg.tasks:
            rec["tasks"] = _tasks(cells, path, llm, cfg)
        if cfg.speed:
            rec.update(cells.run("speed", _speed, llm, cfg, context) or {})
    if cfg.kl and isinstance(base_logits_cache, dict) and "reference" not in base_logits_cache:
        failed = cells.errors.get("kl") or cells.errors.get("load")
        base_logits_cache.setdefault("failed", failed["message"] if failed else "not built")
    rec["eval_seconds"] = time.perf_counter() - t0
    if not rec["errors"]:
        del rec["errors"]
    return rec
