"""Run by tests/distill/test_distributed.py under ``torchrun --nproc_per_node 2``: joins the
group through World.from_env, averages one value, and reports at exit (after the handlers
registered later, atexit being last-in first-out) whether the group was still alive."""
import atexit

import torch
import torch.distributed as dist

from distill.distributed import World


def report() -> None:
    print(f"rank {rank}: group alive at exit: {dist.is_initialized()}", flush=True)


atexit.register(report)
world = World.from_env()
rank = world.rank
assert world.size == 2 and world.mean(torch.tensor(float(rank))) == 0.5
