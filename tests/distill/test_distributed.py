"""DDP: two CPU processes on gloo (torchrun) train the same student as one process with
the same global batch, within float tolerance."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def launch(args: list[str], nproc: int | None, ok: bool = True) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    prefix = [sys.executable] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    done = subprocess.run(prefix + [str(HERE / "ddp_worker.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode == 0) == ok, done.stderr[-3000:]


def test_each_rank_leaves_its_process_group_before_interpreter_teardown():
    """Left to teardown, gloo's threads sometimes aborted a rank that had finished its work
    (SIGABRT, and torchrun failed the run): World.from_env destroys the group at exit."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(HERE / "world_exit_worker.py")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = sorted(line for line in done.stdout.splitlines() if "group alive" in line)
    assert reports == [f"rank {r}: group alive at exit: False" for r in (0, 1)], done.stdout


@pytest.mark.slow
def test_two_gloo_processes_match_one_process_with_the_same_global_batch(models, tmp_path):
    """KL + CE + the hidden loss (DDP's student and the all-reduced projections). The
    gradients differ by the summation order only; AdamW's normalization makes that at
    most ~0.6% of a weight's movement over 5 steps here (bound: 2%)."""
    hidden = "0.5"
    teacher_dir, student_dir = models
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    launch([str(teacher_dir), str(student_dir), str(one), hidden], None)
    launch([str(teacher_dir), str(student_dir), str(two), hidden], 2)
    assert json.loads(two.with_suffix(".json").read_text())["world"] == 2
    l1 = json.loads(one.with_suffix(".json").read_text())["losses"]
    l2 = json.loads(two.with_suffix(".json").read_text())["losses"]
    assert l1 == pytest.approx(l2, rel=1e-5)
    a, b = load_file(one), load_file(two)
    start = load_file(next(student_dir.glob("*.safetensors")))
    for name in a:
        moved = (a[name] - start[name]).abs().max()
        assert moved > 0, name
        diff = (b[name] - a[name]).abs().max()
        assert diff <= 2e-2 * moved, name


@pytest.mark.slow
def test_torchrun_runs_a_recipe_rank_0_exports_it_and_matches_one_process(models, one_thread, tmp_path):
    from distill_recipes import run, write_recipe

    teacher_dir, student_dir = models
    recipe = write_recipe(tmp_path, student_dir, teacher_dir, {"batch_size": 4, "checkpoint_every": 2})
    run(recipe, tmp_path / "one")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "compress.cli", "run", str(recipe), "--no-eval", "--quiet", "--threads", "1",
                           "--output", str(tmp_path / "two")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["healed"]    # no scratch, no checkpoints
    a = load_file(next((tmp_path / "one" / "healed").glob("*.safetensors")))
    b = load_file(next((tmp_path / "two" / "healed").glob("*.safetensors")))
    start = load_file(next(student_dir.glob("*.safetensors")))
    assert a.keys() == b.keys()
    for name in a:
        moved = (a[name] - start[name]).abs().max()
        assert moved > 0 and (b[name] - a[name]).abs().max() <= 2e-2 * moved, name


@pytest.mark.slow
def test_two_processes_resume_from_rank_0s_checkpoint_like_an_uninterrupted_run(models, tmp_path):
    """Rank 0 reads the checkpoint; rank 1 must get its step, weights and AdamW state too
    (otherwise its gradients, averaged into rank 0's, would differ)."""
    teacher_dir, student_dir = models
    whole, resumed, ckpts = tmp_path / "whole.safetensors", tmp_path / "resumed.safetensors", tmp_path / "ckpt"
    launch([str(teacher_dir), str(student_dir), str(whole), "0"], 2)
    launch([str(teacher_dir), str(student_dir), str(resumed), "0", str(ckpts), "3"], 2, ok=False)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-0000002"]
    launch([str(teacher_dir), str(student_dir), str(resumed), "0", str(ckpts)], 2)
    info = json.loads(resumed.with_suffix(".json").read_text())
    assert info["resumed_from"] == 2
    assert info["losses"] == pytest.approx(json.loads(whole.with_suffix(".json").read_text())["losses"], rel=1e-6)
    a, b = load_file(whole), load_file(resumed)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-7, msg=name)
