"""A run's output is progress bars and results: no git, lm-eval or bitsandbytes noise."""
import importlib.util
import json
import subprocess
import sys

import pytest

from evals.harness import run_lm_eval
from evals.lm_eval_quiet import git_commit_hash, quiet_lm_eval

NOISE = ("fatal:", "not a git repository", "Custom kwargs", "aggregation is not", "higher_is_better is not",
         "Token indices sequence length")


def test_git_lookup_outside_a_repository_prints_nothing(tmp_path, monkeypatch, capfd):
    import lm_eval.evaluator as evaluator

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    original = evaluator.get_git_commit_hash
    with quiet_lm_eval():
        assert evaluator.get_git_commit_hash() is None
    assert evaluator.get_git_commit_hash is original
    assert git_commit_hash() is None
    assert capfd.readouterr().err == ""


def test_lm_eval_run_prints_only_progress(tiny_model_dir, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)                       # not a git repository
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    scores = run_lm_eval(tiny_model_dir, ["pydoc_cloze", "pydoc_ppl"], limit=2, batch_size=2)
    assert set(scores) == {"pydoc_cloze", "pydoc_ppl"}
    err = capfd.readouterr().err
    assert not [n for n in NOISE if n in err], err


def _import_bnb_stderr(model_dir, quiet: bool) -> str:
    code = ("import sys; from evals.backend import quiet_bitsandbytes_import; "
            + ("quiet_bitsandbytes_import(sys.argv[1]); " if quiet else "") + "import bitsandbytes")
    return subprocess.run([sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True,
                          check=True).stderr


@pytest.mark.slow      # two fresh interpreters importing torch
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_bitsandbytes_import_for_an_int8_checkpoint_is_quiet(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}))
    if not _import_bnb_stderr(tmp_path, quiet=False).strip():
        pytest.skip("bitsandbytes imports silently on this CPU")
    assert _import_bnb_stderr(tmp_path, quiet=True) == ""
