"""Evaluation of compress checkpoints: perplexity, KL to base, lm-eval tasks, speed, report.

Evals drive the runtime (``compress.runtime.LLM``), never the compression algorithms.
Heavy imports (lm-eval) happen on first use.
"""

from __future__ import annotations

__all__ = ["evaluate_checkpoint", "EvalConfig", "run_lm_eval", "build_kl_reference",
           "kl_to_reference", "measure_speed", "write_report", "load_llm", "task_dir"]

_LAZY = {
    "evaluate_checkpoint": "evals.evaluate", "EvalConfig": "evals.evaluate",
    "run_lm_eval": "evals.harness",
    "build_kl_reference": "evals.kl", "kl_to_reference": "evals.kl",
    "measure_speed": "evals.speed", "write_report": "evals.report",
    "load_llm": "evals.backend", "task_dir": "evals.tasks",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'evals' has no attribute {name!r}")
