"""The distillation loop: a frozen teacher, a student trained on the mixed loss.

AdamW with a linear warmup then a cosine to ``lr * min_lr_ratio`` (a function of the
step alone, so a resumed run needs no scheduler object), global gradient-norm clipping,
a progress bar (tokens, loss, tokens/s, ETA), the held-out loss every ``eval_every``
steps, and an atomic checkpoint every ``checkpoint_every`` steps. A loss or gradient norm
that is not finite stops the run with a StepError naming the step; the checkpoints
written before it stay. Under torch.distributed (``distill/distributed.py``) each rank
takes its share of every global batch and DDP, or FSDP2 (``parallel: fsdp``), averages
the gradients; under FSDP2 the checkpoints hold the parameters and AdamW state gathered
whole, the format one process writes.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from compress.errors import StepError
from distill.checkpoint import CheckpointDir
from distill.config import DistillConfig
from distill.distributed import (OptimizerState, WholeParameters, World, gather_optimizer_state,
                                 gather_parameters, scatter_optimizer_state, scatter_parameters_)
from distill.losses import forward_kl, mixed_loss, next_token_ce


def lr_at(step: int, steps: int, config: DistillConfig) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``steps``."""
    warm = int(config.warmup * steps)
    if step < warm:
        return config.lr * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm - 1)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def layer_pairs(student_layers: int, teacher_layers: int) -> list[tuple[int, int]]:
    """(student, teacher) ``hidden_states`` indices matched for the hidden loss: the
    output of student block i with that of the teacher block at the same depth fraction."""
    return [(i, round(i * teacher_layers / student_layers)) for i in range(1, student_layers + 1)]


def make_projections(student_hidden: int, teacher_hidden: int, n: int, seed: int) -> nn.ModuleList:
    """Learned maps from the student's hidden size to the teacher's: identity when the
    sizes agree, else a seeded random orthogonal start."""
    gen = torch.Generator().manual_seed(seed)
    layers = nn.ModuleList()
    for _ in range(n):
        lin = nn.Linear(student_hidden, teacher_hidden, bias=False)
        with torch.no_grad():
            if student_hidden == teacher_hidden:
                lin.weight.copy_(torch.eye(teacher_hidden))
            else:
                q, _ = torch.linalg.qr(torch.randn(max(student_hidden, teacher_hidden),
                                                   min(student_hidden, teacher_hidden), generator=gen))
                lin.weight.copy_(q if q.shape == lin.weight.shape else q.T)
        layers.append(lin)
    return layers


@dataclass
class DistillResult:
    steps: int
    tokens: int                      # tokens trained on in this process's run (all ranks)
    seconds: float
    losses: list[float] = field(default_factory=list)     # the (global) loss of each step run here
    held_out: list[dict] = field(default_factory=list)    # {"step", "kl", "ce"} over the held-out windows
    resumed_from: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Trainer:
    def __init__(self, student: nn.Module, teacher: nn.Module, config: DistillConfig, where: str,
                 seed: int, world: World | None = None):
        self.student, self.teacher, self.config, self.where = student, teacher, config, where
        self.world = world or World.single()
        self.device = self.world.device
        student.to(self.device)
        teacher.to(self.device)
        self.weights = config.loss.as_dict()
        self.pairs: list[tuple[int, int]] = []
        self.projections = None
        if self.weights["hidden"]:
            s_cfg, t_cfg = student.config, teacher.config
            self.pairs = layer_pairs(s_cfg.num_hidden_layers, t_cfg.num_hidden_layers)
            self.projections = make_projections(s_cfg.hidden_size, t_cfg.hidden_size, len(self.pairs),
                                                seed).to(self.device)
        teacher.requires_grad_(False).eval()
        student.requires_grad_(True).train()
        # FSDP2 shards in place (parameters become DTensors): before the optimizer sees them
        self.sharded = self.world.distributed and config.parallel == "fsdp"
        if self.world.distributed and config.shard_teacher:
            self.world.fully_shard(teacher)
        if self.sharded:
            self.model = self.world.fully_shard(student)
            if self.projections is not None:
                self.world.fully_shard_each(self.projections)
        else:
            self.model = self.world.wrap(student)
        params = list(student.parameters()) + (list(self.projections.parameters()) if self.projections else [])
        self.params = params
        self._resumed = None       # under FSDP2, rank 0's whole checkpoint tensors until scattered
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, betas=tuple(config.betas),
                                           weight_decay=config.weight_decay)

    # --- one step -------------------------------------------------------------------
    def losses(self, ids: torch.Tensor, model: nn.Module) -> tuple[torch.Tensor, dict]:
        hidden = bool(self.pairs)
        with torch.no_grad():
            t_out = self.teacher(ids, output_hidden_states=hidden, use_cache=False)
        s_out = model(ids, output_hidden_states=hidden, use_cache=False)
        states = None
        if hidden:
            states = ([s_out.hidden_states[i] for i, _ in self.pairs],
                      [t_out.hidden_states[j] for _, j in self.pairs], self.projections)
        return mixed_loss(self.weights, s_out.logits, t_out.logits.float(), ids, self.config.temperature,
                          self.config.top_k, states)

    def train_step(self, step: int, steps: int, batch: torch.Tensor) -> float:
        """One optimizer step on the global ``batch``; returns the global mean loss."""
        lr = lr_at(step, steps, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        local = self.world.shard(batch).to(self.device)
        loss, _ = self.losses(local, self.model)
        # DDP averages gradients over ranks: weigh each rank's mean by its share of the batch
        scaled = loss * (local.shape[0] * self.world.size / batch.shape[0])
        self.optimizer.zero_grad(set_to_none=True)
        scaled.backward()
        if self.projections is not None and not self.sharded:    # outside DDP's module: averaged here
            self.world.average_gradients(self.projections.parameters())
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip or float("inf"))
        value = self.world.mean(loss.detach() * local.shape[0] / batch.shape[0] * self.world.size)
        if not (math.isfinite(value) and math.isfinite(float(norm))):
            raise StepError(f"{self.where}: the distillation loss is {value} (gradient norm {float(norm)}) at "
                            f"step {step + 1} of {steps}; stopped before updating the weights")
        self.optimizer.step()
        return value

    @torch.no_grad()
    def held_out(self, windows: torch.Tensor, batch_size: int) -> dict:
        """Forward KL (T = 1) to the teacher and next-token CE, token-weighted over ``windows``."""
        self.student.eval()
        kl = ce = 0.0
        n = windows.shape[0]
        for start in range(0, n, batch_size):
            ids = windows[start:start + batch_size].to(self.device)
            s = self.student(ids, use_cache=False).logits
            t = self.teacher(ids, use_cache=False).logits.float()
            kl += float(forward_kl(s, t)) * ids.shape[0]
            ce += float(next_token_ce(s, ids)) * ids.shape[0]
        self.student.train()
        return {"kl": kl / n, "ce": ce / n}

    def whole_student(self):
        """The student's parameters whole on the CPU (gathered under FSDP2, on every rank):
        what the export writes."""
        if self.sharded:
            return gather_parameters(self.student, keep=True)
        return self.student.cpu()

    def save_checkpoint(self, checkpoints: CheckpointDir, done: int, meta: dict) -> None:
        """Rank 0 writes the checkpoint; under FSDP2 every rank takes part in gathering it."""
        keep = self.world.rank == 0
        if self.sharded:
            student = gather_parameters(self.student, keep)
            projections = gather_parameters(self.projections, keep) if self.projections is not None else None
            optimizer = gather_optimizer_state(self.optimizer, keep)
        else:
            student, projections, optimizer = self.student, self.projections, self.optimizer
        if keep:
            checkpoints.save(done, student, projections, optimizer, meta)

    def load_checkpoint(self, checkpoints: CheckpointDir):
        """Rank 0 reads the newest checkpoint (None: none); under FSDP2 into whole tensors,
        kept in ``self._resumed`` until :meth:`share_resumed_state` scatters them."""
        if not self.sharded:
            return checkpoints.load_latest(self.student, self.projections, self.optimizer)
        student = WholeParameters.empty_like(self.student)
        projections = WholeParameters.empty_like(self.projections) if self.projections is not None else None
        optimizer = OptimizerState()
        resumed = checkpoints.load_latest(student, projections, optimizer)
        if resumed is not None:
            self._resumed = (student.tensors() + (projections.tensors() if projections else []), optimizer.value)
        return resumed

    def share_resumed_state(self, start: int) -> int:
        """Rank 0 reads the checkpoints; the others take its step, weights and AdamW state."""
        step = torch.tensor([start], dtype=torch.long)
        self.world.broadcast_([step])
        start = int(step)
        if start and self.sharded:
            wholes, optimizer = self._resumed or (None, None)
            scatter_parameters_(self.params, wholes)
            scatter_optimizer_state(self.optimizer, self.params, optimizer)
            self._resumed = None
        elif start:
            if self.world.rank != 0:       # AdamW state of the right shapes, overwritten below
                self.optimizer.load_state_dict({
                    "state": {i: {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)} for i, p in enumerate(self.params)},
                    "param_groups": self.optimizer.state_dict()["param_groups"]})
            state = [self.optimizer.state[p][k] for p in self.params for k in ("step", "exp_avg", "exp_avg_sq")]
            self.world.broadcast_(list(self.params) + state)
        return start

    # --- the loop -------------------------------------------------------------------
    def run(self, batches: list[torch.Tensor], held_out: torch.Tensor | None,
            checkpoints: CheckpointDir | None, progress: bool = True, log=print) -> DistillResult:
        cfg, steps = self.config, len(batches)
        start, meta = 0, {"losses": [], "held_out": []}
        if checkpoints is not None and self.world.rank == 0:
            resumed = self.load_checkpoint(checkpoints)
            if resumed is not None:
                start, meta = resumed.step, resumed.meta
                log(f"{self.where}: resuming from the checkpoint of step {start} of {steps} "
                    f"({checkpoints.path(start)})")
        if self.world.distributed:
            start = self.share_resumed_state(start)
        result = DistillResult(steps, 0, 0.0, list(meta["losses"]), list(meta["held_out"]),
                               resumed_from=start or None)
        bar = None
        if progress and self.world.rank == 0:
            from tqdm.auto import tqdm

            total = sum(b.numel() for b in batches)
            bar = tqdm(total=total, initial=sum(b.numel() for b in batches[:start]), unit="tok",
                       unit_scale=True, desc="distill", dynamic_ncols=True)
        # a sharded student's forward is a collective: every rank runs the held-out windows
        evaluate = held_out is not None and held_out.numel() and (self.world.rank == 0 or self.sharded)
        if start == 0 and evaluate:
            result.held_out.append({"step": 0, **self.held_out(held_out, cfg.batch_size)})
        t0 = time.perf_counter()
        try:
            for step in range(start, steps):
                loss = self.train_step(step, steps, batches[step])
                result.losses.append(loss)
                result.tokens += batches[step].numel()
                done = step + 1
                if evaluate and (done == steps or (cfg.eval_every and done % cfg.eval_every == 0)):
                    result.held_out.append({"step": done, **self.held_out(held_out, cfg.batch_size)})
                if bar is not None:
                    post = {"loss": f"{loss:.4f}"}
                    if result.held_out:
                        post["held_out_kl"] = f"{result.held_out[-1]['kl']:.4f}"
                    bar.update(batches[step].numel())
                    bar.set_postfix(post)
                if checkpoints is not None and cfg.checkpoint_every and done % cfg.checkpoint_every == 0 \
                        and done < steps:
                    self.save_checkpoint(checkpoints, done, {"losses": result.losses, "held_out": result.held_out})
                    self.world.barrier()
        except StepError as exc:
            kept = checkpoints.steps() if checkpoints is not None else []
            note = (f"; the last good checkpoint (step {kept[-1]}) stays in {checkpoints.path(kept[-1])}" if kept
                    else "; no checkpoint was written before it")
            raise StepError(f"{exc}{note}") from None
        finally:
            if bar is not None:
                bar.close()
        result.seconds = time.perf_counter() - t0
        self.student.eval()
        return result
