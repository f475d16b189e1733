"""Offline lm-eval task definitions (YAML + jsonl data built by ``build_pydoc_tasks.py``)."""

import functools
from pathlib import Path

TASKS = ("pydoc_ppl", "pydoc_cloze")


def task_dir() -> Path:
    """The folder to give lm-eval as ``include_path``."""
    return Path(__file__).resolve().parent


@functools.lru_cache(maxsize=2)
def task_manager(include_defaults: bool):
    """lm-eval's TaskManager over our task folder, with its ~14k built-in task files
    (indexing them takes about a minute) only where asked: built once a process, so a
    recipe's check of its task names and its evaluation share one index."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir()), include_defaults=include_defaults)


def unknown_tasks(names: list[str]) -> list[str]:
    """The names lm-eval knows neither as a task nor as a group or tag (patterns with
    ``*`` are left to lm-eval)."""
    plain = [t for t in names if "*" not in t]
    if not plain:
        return []
    known = task_manager(not set(plain) <= set(TASKS)).all_tasks
    return [t for t in plain if t not in known]
