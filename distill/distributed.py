"""Data-parallel distillation on torch.distributed.

Under ``torchrun`` (or ``accelerate launch``, which sets the same environment) every
process runs the same recipe; :func:`World.from_env` joins the process group
(``nccl`` on GPUs, ``gloo`` on CPUs) when ``WORLD_SIZE`` > 1. Each rank loads the
student and the teacher (replicated), takes rows ``rank::world_size`` of every global
batch, and DDP averages the gradients, so a step sees the same global batch as one
process would. Rank 0 writes the checkpoints and the export.

``parallel: fsdp`` is refused for now (FSDP2 ``fully_shard`` of the student is not
implemented); DDP needs the whole student and teacher on every device.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class World:
    rank: int
    size: int

    @classmethod
    def single(cls) -> "World":
        return cls(0, 1)

    @classmethod
    def from_env(cls) -> "World":
        """The process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``...),
        joined on first use; a single process without it."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return cls.single()
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def device(self) -> torch.device:
        """This process's GPU (``LOCAL_RANK``) when there is one, else the CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")

    def wrap(self, model: nn.Module) -> nn.Module:
        if not self.distributed:
            return model
        from torch.nn.parallel import DistributedDataParallel

        device = self.device
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch."""
        if not self.distributed:
            return batch
        if batch.shape[0] < self.size:
            raise ValueError(f"a batch of {batch.shape[0]} windows cannot be shared by {self.size} processes; "
                             f"give batch_size >= the number of processes")
        return batch[self.rank::self.size]

    def mean(self, value: torch.Tensor) -> float:
        """The mean of ``value`` over the ranks (a float; each rank gets the same)."""
        if not self.distributed:
            return float(value)
        import torch.distributed as dist

        t = value.detach().float().clone().reshape(1)
        dist.all_reduce(t)
        return float(t) / self.size

    def average_gradients(self, params) -> None:
        if not self.distributed:
            return
        import torch.distributed as dist

        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= self.size

    def broadcast_(self, tensors) -> None:
        """Overwrite every rank's ``tensors`` with rank 0's (in place)."""
        if not self.distributed:
            return
        import torch.distributed as dist

        for t in tensors:
            dist.broadcast(t.data, src=0)

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()
