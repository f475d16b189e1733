"""Data-parallel distillation on torch.distributed: DDP or FSDP2.

Under ``torchrun`` (or ``accelerate launch``, which sets the same environment) every
process runs the same recipe; :func:`World.from_env` joins the process group
(``nccl`` on GPUs, ``gloo`` on CPUs) when ``WORLD_SIZE`` > 1. Each rank takes rows
``rank::world_size`` of every global batch; the gradients are averaged over the ranks,
so a step sees the same global batch as one process would. Rank 0 writes the
checkpoints and the export.

- ``parallel: ddp`` (and ``auto``): the student and the teacher whole on every process,
  DistributedDataParallel averages the gradients.
- ``parallel: fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) shards the
  student's parameters, gradients and AdamW state over the ranks: every decoder block
  (the classes the model lists in ``_no_split_modules``, what accelerate's FSDP
  auto-wrap uses) is one unit, the rest (embeddings, final norm, head) the root unit;
  the hidden-loss projections are sharded one by one. A unit's parameters are gathered
  for its forward and backward only, and reduce-scatter averages the gradients.
  ``shard_teacher: true`` shards the frozen teacher the same way (forward only);
  otherwise it is replicated.

Checkpoints keep one format whatever the mode (``distill/checkpoint.py``): under FSDP
every parameter and AdamW state tensor is gathered whole, one at a time, and rank 0
writes them (:func:`gather_parameters`, :func:`gather_optimizer_state`); on resume
rank 0 reads them and :func:`scatter_parameters_` / :func:`scatter_optimizer_state`
hand every rank its shards.
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class World:
    rank: int
    size: int
    _mesh: object = field(default=None, repr=False, compare=False)

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
        if torch.cuda.is_available():       # FSDP2 and nccl work on the current device: this rank's
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        atexit.register(leave_process_group)
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
        """``model`` under DDP (itself in one process)."""
        if not self.distributed:
            return model
        from torch.nn.parallel import DistributedDataParallel

        device = self.device
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    @property
    def mesh(self):
        """The 1-D device mesh of every rank (FSDP2's data-parallel dimension)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.size,))
        return self._mesh

    def fully_shard(self, model: nn.Module) -> nn.Module:
        """FSDP2 in place: each decoder block one unit, then the root (the rest)."""
        from torch.distributed.fsdp import fully_shard

        for block in decoder_blocks(model):
            fully_shard(block, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        return model

    def fully_shard_each(self, modules: nn.ModuleList) -> nn.ModuleList:
        """FSDP2 on every module of a list that is called module by module (the projections)."""
        from torch.distributed.fsdp import fully_shard

        for module in modules:
            fully_shard(module, mesh=self.mesh)
        return modules

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


def leave_process_group() -> None:
    """Destroy the process group while the interpreter is whole (registered at exit by
    :meth:`World.from_env`). Left to interpreter teardown, a gloo group's worker threads
    can abort the process (``terminate called without an active exception``, SIGABRT) after
    its work is done, and torchrun reports the run as failed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules of the classes the model names in ``_no_split_modules`` (its decoder
    blocks, e.g. ``LlamaDecoderLayer``)."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no decoder blocks to shard (its _no_split_modules "
                         f"{sorted(classes)} names no submodule); FSDP needs them")
    return blocks


# --- whole tensors of a sharded model: the checkpoints' and the export's view ----------------

def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` gathered whole when it is a sharded DTensor (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class WholeParameters:
    """Whole CPU tensors under a module's parameter names, shaped like what
    ``CheckpointDir`` and the export read from a module: ``named_parameters()``. Tied
    names share one tensor, as a module's tied parameters do."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        self.named = named

    def named_parameters(self, remove_duplicate: bool = True):
        seen = set()
        for name, tensor in self.named:
            if remove_duplicate and id(tensor) in seen:
                continue
            seen.add(id(tensor))
            yield name, tensor

    @classmethod
    def empty_like(cls, module: nn.Module) -> "WholeParameters":
        """Uninitialized whole tensors of the module's (global) shapes, to load a checkpoint into."""
        made: dict[int, torch.Tensor] = {}
        named = []
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) not in made:
                made[id(p)] = torch.empty(p.shape, dtype=p.dtype)
            named.append((name, made[id(p)]))
        return cls(named)

    def tensors(self) -> list[torch.Tensor]:
        """One tensor per distinct parameter, in the module's ``parameters()`` order."""
        return [t for _, t in self.named_parameters()]


class OptimizerState:
    """An optimizer's ``state_dict`` held as data (whole tensors), for ``CheckpointDir``."""

    def __init__(self, state: dict | None = None):
        self.value = state

    def state_dict(self) -> dict:
        return self.value

    def load_state_dict(self, state: dict) -> None:
        self.value = state


def gather_parameters(module: nn.Module, keep: bool) -> WholeParameters | None:
    """Every parameter of ``module`` whole on the CPU, one at a time (every rank must
    call it); ``keep`` False: take part in the gathers, keep nothing (returns None)."""
    done: dict[int, torch.Tensor | None] = {}
    named = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in done:
            full = whole(p.detach())
            done[id(p)] = full.cpu().clone() if keep else None
        named.append((name, done[id(p)]))
    return WholeParameters(named) if keep else None


def gather_optimizer_state(optimizer: torch.optim.Optimizer, keep: bool) -> OptimizerState | None:
    """The optimizer's ``state_dict`` with every sharded state tensor gathered whole on
    the CPU (the index-keyed format one process saves); every rank must call it."""
    sd = optimizer.state_dict()
    state: dict[int, dict] = {}
    for index in sorted(sd["state"]):
        for key in sorted(sd["state"][index]):
            full = whole(sd["state"][index][key])
            if keep:
                state.setdefault(index, {})[key] = full.cpu().clone()
    return OptimizerState({"state": state, "param_groups": sd["param_groups"]}) if keep else None


def _from_rank0(like: torch.Tensor, full: torch.Tensor | None) -> torch.Tensor:
    """Rank 0's whole ``full`` placed like ``like``: this rank's shard of a DTensor, or
    the broadcast whole tensor."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor):
        mesh = like.device_mesh
        device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
            else torch.device("cpu")
        buf = full.to(device) if full is not None else torch.empty(like.shape, dtype=like.dtype, device=device)
        return distribute_tensor(buf, mesh, like.placements, src_data_rank=0)
    buf = full.to(like.device) if full is not None else torch.empty(like.shape, dtype=like.dtype,
                                                                    device=like.device)
    dist.broadcast(buf, src=0)
    return buf


@torch.no_grad()
def scatter_parameters_(params: list[torch.Tensor], wholes: list[torch.Tensor] | None) -> None:
    """Overwrite every rank's (sharded) ``params`` with rank 0's whole tensors ``wholes``
    (None on the other ranks), in place."""
    from torch.distributed.tensor import DTensor

    for i, p in enumerate(params):
        placed = _from_rank0(p, wholes[i] if wholes is not None else None)
        if isinstance(p, DTensor):
            p.to_local().copy_(placed.to_local())
        else:
            p.copy_(placed)


def scatter_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                            saved: dict | None) -> None:
    """Load rank 0's whole AdamW state ``saved`` (the index-keyed ``state_dict`` of one
    process; None on the other ranks) into every rank's optimizer, sharded like its params."""
    state = {}
    for i, p in enumerate(params):
        entry = saved["state"][i] if saved is not None else {}
        step = entry.get("step", torch.zeros(())).detach().clone().float()
        state[i] = {"step": _from_rank0(step, step if saved is not None else None),
                    "exp_avg": _from_rank0(p, entry.get("exp_avg")),
                    "exp_avg_sq": _from_rank0(p, entry.get("exp_avg_sq"))}
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
