"""Run by tests/distill/test_distributed.py under ``torchrun --nproc_per_node 2``: joins the
group through World.from_env, averages one value, and reports at exit (after the handlers
registered later, atexit being last-in first-out) whether the group was still alive."""
import atexit
import os

import torch
import torch.distributed as dist

from distill.distributed import World


def report() -> None:
    # one write of a whole line (print writes the newline apart: two ranks' lines could interleave)
    os.write(1, f"rank {rank}: group alive at exit: {dist.is_initialized()}\n".encode())


atexit.register(report)
world = World.from_env()
rank = world.rank
assert world.size == 2 and world.mean(torch.tensor(float(rank))) == 0.5
