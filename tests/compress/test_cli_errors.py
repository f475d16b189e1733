"""Bad input and interruptions on the command line: one line naming what is wrong and
where, exit codes a script can read, and nothing half written left behind."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import yaml

from compress.cli import main
from compress.io.files import atomic_dir, make_temp_dir, sweep_leftovers

TEXT = "Return a new list containing all items from the iterable in ascending order. " * 60


def write_recipe(tmp_path, model_dir, **overrides):
    (tmp_path / "calib.txt").write_text(TEXT)
    doc = {"name": "t", "model": {"path": str(model_dir)},
           "calibration": {"files": ["calib.txt"], "samples": 4, "seq_len": 32},
           "stages": [{"name": "awq", "steps": [{"method": "awq", "bits": 4, "group_size": 64}]}],
           "export": {"output": "out"}, "eval": {"tasks": []}}
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        if field:
            doc[section][field] = value
        else:
            doc[section] = value
    p = tmp_path / "recipe.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("overrides, where, message", [
    ({"calibration.files": ["missing.txt"]}, "calibration.files[0]", "not found"),
    ({"calibration.seq_len": 4096}, "calibration.seq_len", "do not fit the model's context of 512"),
    ({"export.output": "a-file"}, "export.output", "is a file, not a directory"),
    ({"eval": {"tasks": ["pydoc_cloze"], "task_limit": 0}}, "eval.task_limit", "at least 1"),
    ({"eval": {"tasks": ["pydoc_cloze", "no_such_task_anywhere"]}}, "eval.tasks", "no_such_task_anywhere"),
])
def test_dry_run_names_a_bad_input_before_any_work(tmp_path, tiny_llama_dir, capsys, overrides, where, message):
    (tmp_path / "a-file").write_text("x")
    recipe = write_recipe(tmp_path, tiny_llama_dir, **overrides)
    assert main(["run", str(recipe), "--dry-run"]) == 2
    line = error_line(capsys)
    assert where in line and message in line


def test_a_calibration_file_that_is_not_utf8(tmp_path, tiny_llama_dir, capsys):
    recipe = write_recipe(tmp_path, tiny_llama_dir)
    (tmp_path / "calib.txt").write_bytes(b"text \xff\xfe more")
    assert main(["run", str(recipe), "--dry-run"]) == 2
    assert "calibration.files[0]" in error_line(capsys)


def test_the_memory_check_refuses_in_a_dry_run_and_can_be_ignored(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    import compress.memory_estimate as memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    monkeypatch.delenv(memory.IGNORE_ENV, raising=False)
    recipe = write_recipe(tmp_path, tiny_llama_dir)
    assert main(["run", str(recipe), "--dry-run"]) == 2
    assert "--ignore-memory-check" in error_line(capsys)
    try:
        assert main(["run", str(recipe), "--dry-run", "--ignore-memory-check"]) == 0
    finally:
        os.environ.pop(memory.IGNORE_ENV, None)   # the flag sets it for the process


def test_threads_below_one_are_a_usage_error(tmp_path, tiny_llama_dir, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(write_recipe(tmp_path, tiny_llama_dir)), "--threads", "0"])
    assert exit_.value.code == 2 and "--threads: must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_an_interrupt_is_one_line_and_its_temporary_directory_goes(tmp_path, capsys, monkeypatch, signum, code):
    """SIGTERM (as timeout and schedulers send) ends like Ctrl-C: what was being written
    is removed on the way out, and the command says so in one line."""
    import compress.cli as cli

    target = tmp_path / "stage"

    def slow_export(_args):
        with atomic_dir(target) as tmp:
            (tmp / "part").write_text("half")
            os.kill(os.getpid(), signum)
            time.sleep(5)
        return 0

    monkeypatch.setattr(cli, "_cmd_methods", slow_export)
    assert main(["methods"]) == code
    assert error_line(capsys) == "compress methods: interrupted"
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is not cli._raise_terminated   # put back


def test_what_a_killed_run_left_is_swept_and_a_moved_target_put_back(tmp_path):
    from compress.io.files import _host

    target = tmp_path / "stage"
    host = _host()
    dead = 2 ** 22 + 12345   # above Linux's default pid_max: no such process
    (tmp_path / f".stage.tmp-{host}-{dead}-abc").mkdir()
    old = tmp_path / f".stage.old-{host}-{dead}-def"
    old.mkdir()
    (old / "model.safetensors").write_text("the good copy")
    elsewhere = tmp_path / f".stage.tmp-otherhost-{dead}-ghi"   # another machine's run: its pid means nothing here
    elsewhere.mkdir()
    live = make_temp_dir(target, "tmp")   # this process's: not touched
    sweep_leftovers(target)
    assert (target / "model.safetensors").read_text() == "the good copy"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, elsewhere.name, "stage"])
    # a name with glob characters matches only itself
    (tmp_path / "run1").mkdir()
    (tmp_path / f".run1.old-{host}-{dead}-x").mkdir()
    sweep_leftovers(tmp_path / "run[12]")
    assert not (tmp_path / "run[12]").exists() and (tmp_path / f".run1.old-{host}-{dead}-x").exists()


def test_generate_with_a_prompt_past_the_context_is_one_line(tiny_llama_dir, capsys):
    assert main(["generate", str(tiny_llama_dir), "--prompt", "word " * 2000, "--max-tokens", "2"]) == 2
    assert "leaves no room to generate" in error_line(capsys)


def test_eval_checks_its_inputs_first(tiny_llama_dir, tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nothere")]) == 2
    assert "no such checkpoint directory" in error_line(capsys)
    assert main(["eval", str(tiny_llama_dir), "--text", str(tmp_path / "none.txt")]) == 2
    assert "--text" in error_line(capsys)
    assert main(["eval", str(tiny_llama_dir), "--limit", "0", "--tasks", "pydoc_cloze"]) == 2
    assert "--limit" in error_line(capsys)


def test_inspect_exits_1_on_a_checksum_mismatch(tmp_path, tiny_llama_dir, capsys):
    recipe = write_recipe(tmp_path, tiny_llama_dir, stages=[{"name": "q", "steps": [{"method": "rtn", "bits": 8}]}])
    assert main(["run", str(recipe), "--no-eval", "--quiet"]) == 0
    export = tmp_path / "out" / "q"
    assert main(["inspect", str(export)]) == 0
    shard = next(export.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(b"\x00\x01\x02\x03")
    capsys.readouterr()
    assert main(["inspect", str(export)]) == 1
    assert "checksums do not match" in capsys.readouterr().err


def test_make_model_refuses_a_shape_by_name(tmp_path, capsys):
    assert main(["bench", "make-model", "--out", str(tmp_path / "m"), "--hidden", "60", "--heads", "7",
                 "--kv-heads", "7", "--layers", "1", "--intermediate", "64", "--vocab", "64"]) == 2
    assert "--hidden 60 / --heads 7" in error_line(capsys)


def test_a_corrupt_distill_checkpoint_names_its_file(tmp_path):
    from distill.checkpoint import CheckpointDir, CheckpointMismatch

    ckpt = CheckpointDir(tmp_path / "c", {"run": 1}, "stage 'h' step 1 (distill)")
    step = ckpt.path(5)
    step.mkdir(parents=True)
    (step / "state.json").write_text("{not json")
    with pytest.raises(CheckpointMismatch, match=r"state.json: a corrupt checkpoint .* delete"):
        ckpt.latest_state()
    (step / "state.json").write_text(json.dumps({"step": 5, "fingerprint": {"run": 1}}))
    (step / "weights.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    import torch
    with pytest.raises(CheckpointMismatch, match="a corrupt checkpoint"):
        ckpt.load_latest(torch.nn.Linear(2, 2), None, torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))


@pytest.fixture()
def logging_restored():
    """lm-eval's command line attaches log handlers to the stream pytest captures: they go
    after the test (a later test's logs would hit the closed stream)."""
    import logging

    loggers = [logging.getLogger()] + [lg for lg in logging.root.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    saved = {lg: (list(lg.handlers), lg.level, lg.propagate) for lg in loggers}
    yield
    for lg in [logging.getLogger()] + [lg for lg in logging.root.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]:
        handlers, level, propagate = saved.get(lg, ([], logging.NOTSET, True))
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


def test_lm_eval_refusals_are_one_line(capsys, tmp_path, logging_restored):
    assert main(["lm-eval", "--model", "compress", "--model_args", f"pretrained={tmp_path / 'nothere'}",
                 "--tasks", "pydoc_cloze"]) == 2
    assert "not found" in error_line(capsys)
    assert main(["lm-eval", "--model", "compress", "--model_args", f"pretrained={tmp_path}",
                 "--tasks", "no_such_task_anywhere"]) == 2
    assert "Tasks not found: no_such_task_anywhere" in error_line(capsys)


def test_runtime_options_are_checked_and_noted(capsys):
    """A dtype outside the runtime's is refused before loading, naming the option; 'model'
    is the KV cache's default by name (as the bench commands spell it); int8 activations on
    a model without int4 layers are said to do nothing."""
    from pathlib import Path

    import torch

    from compress.runtime import LLM

    embedded = str(Path(__file__).resolve().parents[2] / "models" / "pydoc-llama")
    with pytest.raises(ValueError, match="unknown dtype torch.int8"):
        LLM(embedded, dtype=torch.int8)
    assert main(["generate", embedded, "--prompt", "Return the", "--max-tokens", "2",
                 "--kv-cache-dtype", "model", "--w4-activations", "int8"]) == 0
    assert "--w4-activations int8 has no effect" in capsys.readouterr().err
