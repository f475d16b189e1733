"""Run by tests/distill/test_distributed.py: the same distillation in one process
(``python ddp_worker.py ...``) or in several (``torchrun --nproc_per_node 2 ddp_worker.py
...``, gloo); rank 0 saves the trained student and the step losses."""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from distill.checkpoint import CheckpointDir
from distill.config import DistillConfig, LossWeights
from distill.distributed import World
from distill.trainer import Trainer


class Crash(RuntimeError):
    pass


def main(teacher_dir: str, student_dir: str, out: str, hidden: str, checkpoints: str = "",
         crash_after: str = "0") -> None:
    """``checkpoints``: a checkpoint directory (every 2 steps); ``crash_after`` > 0: every
    rank raises after that many steps (a run that dies after a checkpoint)."""
    torch.set_num_threads(1)
    world = World.from_env()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    config = DistillConfig(loss=LossWeights(forward_kl=1.0, ce=0.2, hidden=float(hidden)), batch_size=4,
                           lr=3e-4, warmup=0.0, eval_every=0, checkpoint_every=2 if checkpoints else 0)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(2, 512, (4, 32), generator=gen) for _ in range(5)]
    trainer = Trainer(student, teacher, config, "ddp test", seed=0, world=world)
    if int(crash_after):
        step = trainer.train_step

        def crashing(i, *a):
            if i == int(crash_after):
                raise Crash(f"stopped before step {i + 1}")
            return step(i, *a)

        trainer.train_step = crashing
    store = CheckpointDir(checkpoints, {"test": 1}, "ddp test") if checkpoints else None
    result = trainer.run(batches, None, store, progress=False)
    if world.rank == 0:
        save_file({n: p.detach().contiguous() for n, p in student.named_parameters()}, str(Path(out)))
        Path(out).with_suffix(".json").write_text(json.dumps({"losses": result.losses, "world": world.size,
                                                              "resumed_from": result.resumed_from}))


if __name__ == "__main__":
    main(*sys.argv[1:])
