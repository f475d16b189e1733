"""Offline lm-eval task definitions (YAML + jsonl data built by ``build_pydoc_tasks.py``)."""

from pathlib import Path

TASKS = ("pydoc_ppl", "pydoc_cloze")


def task_dir() -> Path:
    """The folder to give lm-eval as ``include_path``."""
    return Path(__file__).resolve().parent
