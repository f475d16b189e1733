"""FSDP2 (``parallel: fsdp``): two CPU processes on gloo (torchrun) shard the student
(and the teacher) and train it like one process with the same global batch; a killed
run resumes from rank 0's checkpoint, written in the single-process format.

Run as a script (``python test_fsdp.py ...`` or under torchrun) this file is the worker
the tests launch: it trains and rank 0 saves the student and the step losses."""
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


# --- the worker ----------------------------------------------------------------------------

def worker(teacher_dir: str, student_dir: str, out: str, parallel: str, shard_teacher: str,
           checkpoints: str = "", crash_after: str = "0") -> None:
    """``checkpoints``: a checkpoint directory (every 2 steps); ``crash_after`` > 0: every
    rank raises before that step (a run that dies after a checkpoint)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from distill.checkpoint import CheckpointDir
    from distill.config import DistillConfig, LossWeights
    from distill.distributed import World
    from distill.trainer import Trainer

    torch.set_num_threads(1)
    world = World.from_env()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    config = DistillConfig(loss=LossWeights(forward_kl=1.0, ce=0.2, hidden=0.5), batch_size=4, lr=3e-4,
                           warmup=0.0, eval_every=0, checkpoint_every=2 if checkpoints else 0,
                           parallel=parallel, shard_teacher=shard_teacher == "1")
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(2, 512, (4, 32), generator=gen) for _ in range(5)]
    held_out = torch.randint(2, 512, (3, 32), generator=gen)
    trainer = Trainer(student, teacher, config, "fsdp test", seed=0, world=world)
    if int(crash_after):
        step = trainer.train_step

        def crashing(i, *a):
            if i == int(crash_after):
                raise RuntimeError(f"stopped before step {i + 1}")
            return step(i, *a)

        trainer.train_step = crashing
    store = CheckpointDir(checkpoints, {"test": 1}, "fsdp test") if checkpoints else None
    result = trainer.run(batches, held_out, store, progress=False)
    weights = trainer.whole_student()                 # a collective under FSDP: every rank
    if world.rank == 0:
        save_file({n: p.detach().contiguous() for n, p in weights.named_parameters()}, out)
        Path(out).with_suffix(".json").write_text(json.dumps({
            "losses": result.losses, "held_out": result.held_out, "world": world.size,
            "resumed_from": result.resumed_from, "sharded": trainer.sharded}))


# --- the tests -----------------------------------------------------------------------------

def launch(args: list[str], nproc: int | None, ok: bool = True) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    prefix = [sys.executable] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    done = subprocess.run(prefix + [__file__, *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert (done.returncode == 0) == ok, done.stderr[-3000:]
    out = Path(args[2]).with_suffix(".json")
    return json.loads(out.read_text()) if ok else {}


@pytest.fixture
def tied_models(tmp_path):
    """A sharp tiny llama with a tied head, and a noisy copy: the tied embedding is the
    root unit's, the blocks are units of their own."""
    from distill_recipes import perturbed_copy, sharp_teacher

    teacher = sharp_teacher(tmp_path / "teacher", tie_word_embeddings=True)
    return teacher, perturbed_copy(teacher, tmp_path / "student")


def assert_same_training(a: dict, b: dict, start: dict, share: float) -> None:
    """Every weight moved, and ``b`` is within ``share`` of that movement of ``a``."""
    assert a.keys() == b.keys()
    for name in a:
        moved = (a[name] - start[name]).abs().max()
        assert moved > 0, name
        assert (b[name] - a[name]).abs().max() <= share * moved, name


@pytest.mark.slow
def test_two_fsdp_processes_with_a_sharded_teacher_match_one_process(tied_models, tmp_path):
    """KL + CE + the hidden loss through sharded projections; a tied head; the teacher
    sharded too. Gradients differ from one process's by the summation order only
    (reduce-scatter instead of one backward): measured 0.16% of a weight's movement over
    the 5 steps at most, losses within 1e-7 (bounds: 2%, 1e-5)."""
    teacher_dir, student_dir = tied_models
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    single = launch([teacher_dir, student_dir, one, "fsdp", "1"], None)
    sharded = launch([teacher_dir, student_dir, two, "fsdp", "1"], 2)
    assert not single["sharded"] and sharded["sharded"] and sharded["world"] == 2
    assert sharded["losses"] == pytest.approx(single["losses"], rel=1e-5)
    assert [h["kl"] for h in sharded["held_out"]] == pytest.approx([h["kl"] for h in single["held_out"]], rel=1e-5)
    a, b = load_file(one), load_file(two)
    assert "lm_head.weight" not in b                                  # the tied head once, as one process writes it
    assert_same_training(a, b, load_file(next(student_dir.glob("*.safetensors"))), 2e-2)


@pytest.mark.slow
def test_fsdp_resumes_from_rank_0s_whole_checkpoint_like_an_uninterrupted_run(models, tmp_path):
    """The checkpoint holds whole tensors (the single-process format); rank 1 gets its
    shards of the weights and of AdamW's state back from rank 0's read."""
    teacher_dir, student_dir = models
    whole, resumed, ckpts = tmp_path / "whole.safetensors", tmp_path / "resumed.safetensors", tmp_path / "ckpt"
    uninterrupted = launch([teacher_dir, student_dir, whole, "fsdp", "0"], 2)
    launch([teacher_dir, student_dir, resumed, "fsdp", "0", ckpts, "3"], 2, ok=False)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-0000002"]
    saved = load_file(ckpts / "step-0000002" / "weights.safetensors")
    start = load_file(next(student_dir.glob("*.safetensors")))
    assert {n: t.shape for n, t in saved.items() if not n.startswith("projection.")} == \
        {n: t.shape for n, t in start.items()}
    state = load_file(ckpts / "step-0000002" / "optimizer.safetensors")
    assert state["state.0.exp_avg"].shape == start["model.embed_tokens.weight"].shape
    info = launch([teacher_dir, student_dir, resumed, "fsdp", "0", ckpts], 2)
    assert info["resumed_from"] == 2
    assert info["losses"] == pytest.approx(uninterrupted["losses"], rel=1e-6)
    a, b = load_file(whole), load_file(resumed)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-7, msg=name)


@pytest.mark.slow
def test_torchrun_runs_an_fsdp_recipe_and_rank_0_exports_what_one_process_does(models, one_thread, tmp_path):
    from distill_recipes import run, write_recipe

    teacher_dir, student_dir = models
    recipe = write_recipe(tmp_path, student_dir, teacher_dir,
                          {"batch_size": 4, "checkpoint_every": 2, "parallel": "fsdp"})
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
    assert_same_training(a, b, load_file(next(student_dir.glob("*.safetensors"))), 2e-2)


def test_fsdp_in_one_process_trains_like_the_default(models, one_thread, tmp_path):
    """Nothing to shard in one process: ``parallel: fsdp`` is the plain loop."""
    from distill_recipes import run, write_recipe

    teacher_dir, student_dir = models
    budget = {"tokens": 32 * 2 * 3, "seq_len": 32}
    run(write_recipe(tmp_path, student_dir, teacher_dir, budget), tmp_path / "plain")
    run(write_recipe(tmp_path, student_dir, teacher_dir, {**budget, "parallel": "fsdp"}, name="fsdp.yaml"),
        tmp_path / "fsdp")
    a = load_file(next((tmp_path / "plain" / "healed").glob("*.safetensors")))
    b = load_file(next((tmp_path / "fsdp" / "healed").glob("*.safetensors")))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


if __name__ == "__main__":
    worker(*sys.argv[1:])
