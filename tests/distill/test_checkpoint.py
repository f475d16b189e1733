"""Checkpoints: a real run killed with SIGKILL mid-way and rerun resumes from its last
checkpoint and ends bit-identical to an uninterrupted run; a checkpoint of another
recipe is refused by name."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distill.checkpoint import CheckpointMismatch
from distill_recipes import run, write_recipe

REPO = Path(__file__).resolve().parents[2]

# The run checkpoints every 3 steps, each checkpoint replacing the one before. The child
# stops in step 8 (its update done) until it is killed, so the kill lands between the
# checkpoints of steps 6 and 9 however late the parent looks; with steps that were only
# slowed down, a parent held up for a few steps missed step 6 (replaced by step 9) or
# killed the run after step 12.
HANG_IN_STEP = 8
CHILD = f"""
import sys, time
import torch
torch.set_num_threads(1)
from distill.trainer import Trainer
step = Trainer.train_step

def hanging_step(self, i, *a, **kw):
    value = step(self, i, *a, **kw)
    if i + 1 == {HANG_IN_STEP}:
        time.sleep(600)                 # killed here
    return value

Trainer.train_step = hanging_step
from pathlib import Path
from compress.pipeline import compress_stages
from compress.recipe import load_recipe
compress_stages(load_recipe(Path(sys.argv[1])), Path(sys.argv[2]), progress=False, log=lambda *_: None)
"""


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Many tiny ops (see tests/conftest.py::one_thread)."""


def export_tensors(directory: Path) -> dict:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_killed_run_resumes_from_its_checkpoint_and_ends_bit_identical(models, tmp_path):
    teacher_dir, student_dir = models
    recipe = write_recipe(tmp_path, student_dir, teacher_dir, {"checkpoint_every": 3, "eval_every": 5})
    whole = run(recipe, tmp_path / "whole")
    assert whole.stats["distill"]["resumed_from_step"] is None

    ckpts = tmp_path / "out" / "healed.distill-checkpoints"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(recipe), str(tmp_path / "out")], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (ckpts.is_dir() and any(p.name == "step-0000006" for p in ckpts.iterdir())):
            assert child.poll() is None, "the run ended before its second checkpoint"
            assert time.monotonic() < deadline, "no checkpoint of step 6 within 120 s"
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)   # also when a check failed: it would hang
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not (tmp_path / "out" / "healed").exists()

    resumed = run(recipe, tmp_path / "out")
    stats = resumed.stats["distill"]
    assert stats["resumed_from_step"] == 6 and stats["tokens_this_run"] < stats["tokens"]
    assert stats["held_out"] == whole.stats["distill"]["held_out"]        # kept across the kill
    got, want = export_tensors(tmp_path / "out" / "healed"), export_tensors(tmp_path / "whole" / "healed")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert not ckpts.exists()


def test_a_checkpoint_of_another_recipe_is_refused_naming_what_differs(models, tmp_path):
    from compress.errors import StepError

    teacher_dir, student_dir = models
    blows_up = {"lr": 1e30, "warmup": 0.0, "grad_clip": 0.0, "checkpoint_every": 1}
    with pytest.raises(StepError, match="loss is nan"):
        run(write_recipe(tmp_path, student_dir, teacher_dir, blows_up), tmp_path / "out")
    changed = write_recipe(tmp_path, student_dir, teacher_dir, {**blows_up, "lr": 1e-4})
    with pytest.raises(CheckpointMismatch, match=r"step 1 \(distill\): .*step-0+\d is a checkpoint of a different "
                                                 r"run \(step.lr: checkpoint 1e\+30, now 0.0001\).*delete .*"
                                                 r"healed.distill-checkpoints to start over"):
        run(changed, tmp_path / "out")
