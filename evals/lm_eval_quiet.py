"""lm-eval without its two lines of noise that say nothing about the scores.

* ``simple_evaluate`` records a ``git_hash`` by running ``git describe`` in the working
  directory with stderr inherited: outside a repository every run prints ``fatal: not a
  git repository``. :func:`quiet_lm_eval` swaps in the same lookup with stderr captured
  (the hash is still recorded when there is one).
* Every task with a ``custom_dataset`` logs a note on passing ``--metadata``; our local
  tasks (``evals.tasks.TASKS``) load their own files and take no metadata.

Both changes last only for the ``with`` block.
"""

from __future__ import annotations

import logging
import subprocess
from contextlib import contextmanager

TASK_LOGGER = "lm_eval.api.task"
CUSTOM_DATASET_NOTE = "Custom kwargs can be passed to `--metadata`"


def git_commit_hash() -> str | None:
    """``git describe --always`` in the working directory, or None (no git, no repository)."""
    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True,
                             check=False)
    except OSError:
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


class _LocalTaskNoteFilter(logging.Filter):
    """Drops the ``--metadata`` note for our own local tasks only."""

    def filter(self, record: logging.LogRecord) -> bool:
        from evals.tasks import TASKS

        message = record.getMessage()
        return not (CUSTOM_DATASET_NOTE in message and message.split(":", 1)[0] in TASKS)


@contextmanager
def quiet_lm_eval():
    import lm_eval.evaluator as evaluator

    saved = evaluator.get_git_commit_hash
    note_filter = _LocalTaskNoteFilter()
    task_logger = logging.getLogger(TASK_LOGGER)
    evaluator.get_git_commit_hash = git_commit_hash
    task_logger.addFilter(note_filter)
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = saved
        task_logger.removeFilter(note_filter)
