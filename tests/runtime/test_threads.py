"""runtime/threads.py: set-up work on a thread that exits (so that the engine's thread is
the only one holding an OpenMP pool)."""
from __future__ import annotations

import threading

import pytest

from compress.runtime.threads import run_on_fresh_thread


def test_runs_on_another_thread_and_returns_its_result():
    main = threading.get_ident()
    ident, value = run_on_fresh_thread(lambda x, y=0: (threading.get_ident(), x + y), 2, y=3)
    assert ident != main and value == 5


def test_its_exception_is_raised_on_the_caller():
    def fail():
        raise FileNotFoundError("no checkpoint at /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        run_on_fresh_thread(fail)
