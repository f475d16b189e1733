import json
import logging

import pytest

from evals.lm_eval_cli import _with_task_dir, main
from evals.tasks import task_dir


def test_arguments_pass_through_with_our_task_dir():
    argv = ["run", "--model", "compress", "--tasks", "pydoc_cloze"]
    assert _with_task_dir(argv) == argv + ["--include_path", str(task_dir())]
    mine = ["--model", "compress", "--include_path", "/x"]
    assert _with_task_dir(mine) == mine
    assert _with_task_dir(["--help"]) == ["--help"]


@pytest.fixture
def restore_lm_eval_logging():
    """lm-eval's CLI gives its logger a handler on the stderr of the moment (the test's
    capture, closed afterwards) and INFO level: later tests would log into a closed file."""
    logger = logging.getLogger("lm_eval")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


@pytest.mark.slow
def test_cli_runs_compress_model(tiny_model_dir, tmp_path, capsys, restore_lm_eval_logging):
    out = tmp_path / "out"
    main(["run", "--model", "compress", "--model_args", f"pretrained={tiny_model_dir},batch_size=4",
          "--tasks", "pydoc_cloze", "--limit", "4", "--output_path", str(out)])
    printed = capsys.readouterr().out
    assert "pydoc_cloze" in printed and "acc" in printed
    results = [json.loads(p.read_text()) for p in out.rglob("results*.json")]
    assert results and "pydoc_cloze" in results[0]["results"]
