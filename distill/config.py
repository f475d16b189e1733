"""``method: distill``: the recipe step's settings (see ``distill/__init__.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from compress.config import check


@dataclass
class LossWeights:
    """The loss is ``sum weight * part`` over these parts (``distill/losses.py``)."""
    forward_kl: float = 1.0        # KL(teacher || student) on the logits at ``temperature``
    reverse_kl: float = 0.0        # KL(student || teacher)
    ce: float = 0.0                # next-token cross-entropy on the training text
    hidden: float = 0.0            # 1 - cos(projected student hidden state, teacher's), per block

    def as_dict(self) -> dict[str, float]:
        return {"forward_kl": self.forward_kl, "reverse_kl": self.reverse_kl, "ce": self.ce, "hidden": self.hidden}

    def validate(self) -> None:
        for name, w in self.as_dict().items():
            check(w >= 0, name, f"a loss weight must be >= 0, got {w}")
        check(any(self.as_dict().values()), "forward_kl",
              "every loss weight is zero: give forward_kl, reverse_kl, ce or hidden a weight > 0")


@dataclass
class DistillConfig:
    loss: LossWeights = field(default_factory=LossWeights)
    temperature: float = 1.0
    top_k: int | None = None           # teacher logits restricted to its top k tokens
    # the training budget; None: the recipe's training section (tokens / seq_len), or
    # 262144 tokens in windows of 256 for the default text
    tokens: int | None = None
    seq_len: int | None = None
    batch_size: int = 8                # windows per optimizer step (the global batch under DDP)
    lr: float = 1e-4                   # AdamW peak learning rate
    min_lr_ratio: float = 0.1          # the cosine ends at lr * min_lr_ratio
    warmup: float = 0.05               # linear warmup over this fraction of the steps
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0             # max global gradient norm (0: none)
    teacher_dtype: Literal["float32", "bfloat16"] = "float32"
    held_out_windows: int = 8          # windows of the training text kept out of training
    eval_every: int = 50               # held-out loss every N steps (and at the end); 0: end only
    checkpoint_every: int = 50         # an atomic checkpoint every N steps; 0: none
    seed: int | None = None            # data order and projection init (None: the recipe's seed)
    # under torchrun: ddp (auto) replicates the student; fsdp shards it (FSDP2 fully_shard)
    parallel: Literal["auto", "ddp", "fsdp"] = "auto"
    shard_teacher: bool = False        # under torchrun: shard the frozen teacher too (FSDP2) instead of replicating it

    def validate(self) -> None:
        check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        check(self.top_k is None or self.top_k >= 1, "top_k", f"must be >= 1, got {self.top_k}")
        check(self.tokens is None or self.tokens >= 1, "tokens", f"must be >= 1, got {self.tokens}")
        check(self.seq_len is None or self.seq_len >= 2, "seq_len", f"must be >= 2, got {self.seq_len}")
        check(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        check(0 <= self.warmup < 1, "warmup", f"a fraction of the steps in [0, 1), got {self.warmup}")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas",
              f"two numbers in [0, 1), got {self.betas}")
        check(self.grad_clip >= 0, "grad_clip", f"must be >= 0, got {self.grad_clip}")
        check(self.held_out_windows >= 0, "held_out_windows", f"must be >= 0, got {self.held_out_windows}")
        check(self.eval_every >= 0, "eval_every", f"must be >= 0, got {self.eval_every}")
        check(self.checkpoint_every >= 0, "checkpoint_every", f"must be >= 0, got {self.checkpoint_every}")
