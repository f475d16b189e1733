"""The arms of ``compress bench minitron`` as data, and the recipe each one runs.

An arm is one model to measure: the teacher; a pruned start (``width`` and ``depth``
importance pruning, ``random`` indices of the width shape); a pruned start healed with
logit KD (``<family>-kd-<tokens>``); or the width architecture trained from a random
init (``scratch-ce-<tokens>``, ``scratch-kd-<tokens>``). The KD arms at the largest token
budget of ``width``, ``random`` and ``scratch`` are the headline arms and run once per
seed; every other arm runs with the first seed. Each pruned or healed arm is a recipe
(``prune_recipe`` / ``heal_recipe``): the experiment runs our own ``method: prune`` and
``method: distill``, and the recipes are written beside the results so that any arm can be
rerun with ``compress run``.
"""
from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("width", "depth", "random", "scratch")
PRUNED_FAMILIES = ("width", "depth", "random")
HEADLINE_FAMILIES = ("width", "random", "scratch")

# About half of the embedded model's 6.82M parameters (3.49M, 51.2%): hidden 256 -> 192,
# MLP 768 -> 384, one query head per kv group (4 -> 2), head_dim 64 kept.
WIDTH_TARGETS = {"hidden_size": 192, "intermediate_size": 384, "num_attention_heads": 2}
# 6 -> 3 blocks keeps 4.46M parameters (65%: the embedding and head stay whole); 2 blocks would be 3.67M (54%)
DEPTH_LAYERS = 3


@dataclass(frozen=True)
class Arm:
    name: str
    family: str              # teacher | width | depth | random | scratch
    heal: str | None         # None: measured as it starts; "kd": forward KL to the teacher; "ce": next-token CE
    tokens: int              # training tokens (0: none)
    seed: int
    start: str | None        # the arm whose model this one trains (a pruned start or a scratch init)

    @property
    def trained(self) -> bool:
        return self.heal is not None

    @property
    def group(self) -> tuple[str, str | None, int]:
        """Arms that differ only by seed share a group (their spread is the seed spread)."""
        return self.family, self.heal, self.tokens


def token_label(tokens: int) -> str:
    """250000 -> '250k', 1000000 -> '1m', 20000 -> '20k', 1234 -> '1234'."""
    if tokens and tokens % 1_000_000 == 0:
        return f"{tokens // 1_000_000}m"
    if tokens and tokens % 1000 == 0:
        return f"{tokens // 1000}k"
    return str(tokens)


def _seeded(name: str, seed: int, first: int) -> str:
    return name if seed == first else f"{name}-s{seed}"


def plan_arms(families: list[str], tokens: list[int], seeds: list[int]) -> list[Arm]:
    """Every arm, in the order they run: a start before the arms that train it, every arm
    of the first seed before the other seeds' headline arms."""
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown arm family {unknown[0]!r}; known: {', '.join(FAMILIES)}")
    if not tokens or any(n < 1 for n in tokens):
        raise ValueError(f"token budgets must be positive, got {tokens}")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct and at least one, got {seeds}")
    first, top = seeds[0], max(tokens)
    arms = [Arm("teacher", "teacher", None, 0, first, None)]
    for seed in seeds:              # the first seed's whole table, then the headline arms' other seeds
        headline_only = seed != first
        for family in (f for f in FAMILIES if f in families):
            if headline_only and family not in HEADLINE_FAMILIES:
                continue
            if family == "scratch":
                start = _seeded("scratch-init", seed, first)
                arms.append(Arm(start, family, None, 0, seed, None))
                for n in sorted(set(tokens)):
                    for heal in ("ce", "kd"):
                        if headline_only and (heal, n) != ("kd", top):
                            continue
                        arms.append(Arm(_seeded(f"scratch-{heal}-{token_label(n)}", seed, first), family, heal,
                                        n, seed, start))
                continue
            # importance pruning is deterministic: one start for every seed; random draws per seed
            start = _seeded(family, seed, first) if family == "random" else family
            if not any(a.name == start for a in arms):
                arms.append(Arm(start, family, None, 0, seed, None))
            for n in sorted(set(tokens)):
                if headline_only and n != top:
                    continue
                arms.append(Arm(_seeded(f"{family}-kd-{token_label(n)}", seed, first), family, "kd", n, seed,
                                start))
    return arms


def prune_targets(family: str, width_targets: dict, depth_layers: int = DEPTH_LAYERS) -> tuple[dict, str]:
    """(targets, strategy) of a pruned family."""
    if family == "width":
        return dict(width_targets), "importance"
    if family == "random":
        return dict(width_targets), "random"
    if family == "depth":
        return {"num_hidden_layers": depth_layers}, "importance"
    raise ValueError(f"{family!r} is not a pruned family ({', '.join(PRUNED_FAMILIES)})")


def prune_recipe(arm: Arm, teacher_dir: str, models_dir: str, calib_file: str, width_targets: dict,
                 calib_samples: int = 64, depth_layers: int = DEPTH_LAYERS) -> dict:
    """The recipe that writes ``arm``'s pruned model to ``models_dir/<arm.name>``."""
    targets, strategy = prune_targets(arm.family, width_targets, depth_layers)
    step = {"method": "prune", "targets": targets, "strategy": strategy, "seed": arm.seed}
    return {"name": arm.name, "seed": arm.seed, "model": {"path": teacher_dir},
            "calibration": {"files": [calib_file], "samples": calib_samples, "seq_len": 256},
            "stages": [{"name": arm.name, "steps": [step]}], "export": {"output": models_dir}}


@dataclass(frozen=True)
class HealSettings:
    """What every trained arm shares, except the learning rate and weight decay, which
    differ between healing a pruned model and training from a random init."""
    seq_len: int = 256
    batch_size: int = 8
    heal_lr: float = 3e-3                # best of 3e-4 / 1e-3 / 3e-3 / 1e-2 for width + KD at 250k tokens
    heal_weight_decay: float = 0.0
    scratch_lr: float = 3e-3             # the teacher's own; best of 1e-3 / 3e-3 / 1e-2 for scratch at 250k
    scratch_weight_decay: float = 0.1    # and weight decay (models/pydoc-llama/README.md)
    warmup: float = 0.05
    min_lr_ratio: float = 0.1
    checkpoint_every: int = 50


def heal_recipe(arm: Arm, start_dir: str, teacher_dir: str, models_dir: str, s: HealSettings,
                train_text: str | None = None) -> dict:
    """The recipe that trains ``start_dir`` into ``models_dir/<arm.name>``: forward KL at
    T = 1 to the teacher (``kd``) or next-token CE (``ce``) on ``arm.tokens`` tokens of the
    default training text (the pydoc train split, no calibration or eval document) or of
    ``train_text``, in an order drawn from ``arm.seed``."""
    scratch = arm.family == "scratch"
    loss = {"forward_kl": 1.0, "ce": 0.0} if arm.heal == "kd" else {"forward_kl": 0.0, "ce": 1.0}
    step = {"method": "distill", "teacher": teacher_dir, "loss": loss, "temperature": 1.0, "tokens": arm.tokens,
            "seq_len": s.seq_len, "batch_size": s.batch_size,
            "lr": s.scratch_lr if scratch else s.heal_lr,
            "weight_decay": s.scratch_weight_decay if scratch else s.heal_weight_decay,
            "warmup": s.warmup, "min_lr_ratio": s.min_lr_ratio, "eval_every": 0,
            "checkpoint_every": s.checkpoint_every, "seed": arm.seed}
    doc = {"name": arm.name, "seed": arm.seed, "model": {"path": start_dir},
           "stages": [{"name": arm.name, "steps": [step]}], "export": {"output": models_dir}}
    if train_text is not None:
        doc["training"] = {"files": [train_text], "tokens": arm.tokens, "seq_len": s.seq_len, "seed": arm.seed}
    return doc
