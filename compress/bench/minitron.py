"""``compress bench minitron``: does importance pruning + KD healing beat random pruning
and training from scratch? (issue 22's experiment)

On the embedded model (the teacher; ``--teacher``), our own ``method: prune`` cuts it
three ways -- ``width`` (hidden / MLP / heads by calibrated importance,
``--width-targets``; 51% of the parameters by default), ``depth`` (6 -> ``--depth-layers``
3 blocks by Block Importance: 65%, the embedding and head staying whole) and ``random``
(seeded indices of the width shape) -- and ``method: distill`` heals each with
``--tokens`` tokens of logit KD (forward KL, T = 1) from the teacher. The ``scratch``
arms train a random init of the width architecture on the same tokens, with CE and with
KD from the teacher. Every model is exported and then scored by the runtime on the eval
text (``data/pydoc/eval.txt``, never trained on): eval loss and perplexity (256-token
windows), KL(teacher || arm) and top-1 agreement with the teacher, and recovery
R = (L_pruned - L_healed) / (L_pruned - L_teacher). The KD arms at the largest budget of
width, random and scratch run once per ``--seeds`` seed (the seed spread).

Writes ``OUT/recipes/<arm>.yaml`` (rerun any arm with ``compress run``), ``OUT/models/``
(every exported model), ``OUT/arms/<arm>.json`` (one arm's result; a rerun with the same
settings reuses it, so a stopped experiment continues where it stopped), and
``OUT/results.json`` + ``OUT/results.md`` (the table, seed spreads and goals, also
printed). Training tokens/s are measured on whatever else the machine is running: the
table gives the load average around each arm.

    compress bench minitron --tokens 20000 --arms width --seeds 0      # a smoke run (minutes)
    nice -n 15 compress bench minitron --out out/minitron-exp --progress   # the experiment
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from compress.bench.minitron_arms import (DEPTH_LAYERS, FAMILIES, WIDTH_TARGETS, Arm, HealSettings, heal_recipe,
                                          plan_arms, prune_recipe)
from compress.bench.minitron_results import add_recovery, goals, markdown, seed_summary
from compress.errors import UserError
from compress.io.files import atomic_write_text
from compress.cli_args import positive_int

REPO = Path(__file__).resolve().parents[2]
EMBEDDED_MODEL = REPO / "models" / "pydoc-llama"
EVAL_TEXT = REPO / "data" / "pydoc" / "eval.txt"
CALIB_TEXT = REPO / "data" / "pydoc" / "calib.txt"
EVAL_SEQ_LEN = 256          # the teacher and every trained arm see 256-token windows
DEFAULT_TOKENS = "250k,1m"


class MinitronSettingsError(UserError):
    """A bench option that cannot work (names the option)."""


def parse_tokens(text: str) -> list[int]:
    """'250k,1m' -> [250000, 1000000] (plain integers too)."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        scale = {"k": 1000, "m": 1_000_000}.get(p[-1:], 1)
        try:
            value = int(float(p[:-1] if scale > 1 else p) * scale)
        except ValueError:
            raise MinitronSettingsError(f"--tokens: {part!r} is not a token count (e.g. 250000, 250k, 1m)") from None
        if value < EVAL_SEQ_LEN:
            raise MinitronSettingsError(f"--tokens: {part!r} is less than one {EVAL_SEQ_LEN}-token window")
        out.append(value)
    return out


def parse_targets(text: str) -> dict:
    """'hidden_size=192,intermediate_size=384' -> {'hidden_size': 192, 'intermediate_size': 384}."""
    from pruning.prune import TARGET_KEYS

    out = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in TARGET_KEYS or key == "num_hidden_layers" or not value.strip().isdigit():
            raise MinitronSettingsError(f"--width-targets: {part!r} is not KEY=INT with KEY one of "
                                        f"{', '.join(k for k in TARGET_KEYS if k != 'num_hidden_layers')}")
        out[key] = int(value)
    return out


def add_arguments(p) -> None:
    p.add_argument("--out", default="out/minitron-exp", help="output directory (results, recipes, models)")
    p.add_argument("--teacher", default=str(EMBEDDED_MODEL), help="the teacher model directory (the embedded model)")
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="training budgets, comma-separated (e.g. 20000, 250k,1m)")
    p.add_argument("--seeds", default="0,1",
                   help="seeds of the headline arms (width/random/scratch KD at the largest budget); the first "
                        "seed runs every other arm")
    p.add_argument("--arms", default=",".join(FAMILIES),
                   help=f"families to run, comma-separated, of {', '.join(FAMILIES)} (the teacher always runs)")
    p.add_argument("--threads", type=positive_int, default=2,
                   help="torch threads for pruning, training and evaluation (on a machine busy with other work, 1: "
                        "two OpenMP threads that wait on each other ran distillation 5-10x slower there)")
    p.add_argument("--width-targets", default=",".join(f"{k}={v}" for k, v in WIDTH_TARGETS.items()),
                   help="prune targets of the width and random arms (and the scratch architecture)")
    p.add_argument("--depth-layers", type=int, default=DEPTH_LAYERS, help="blocks the depth arm keeps")
    p.add_argument("--heal-lr", type=float, default=HealSettings.heal_lr, help="peak lr of KD healing")
    p.add_argument("--scratch-lr", type=float, default=HealSettings.scratch_lr, help="peak lr of the scratch arms")
    p.add_argument("--batch-size", type=int, default=HealSettings.batch_size, help="256-token windows per step")
    p.add_argument("--kl-windows", type=int, default=64, help="256-token windows of the eval text for KL / top-1")
    p.add_argument("--calib-samples", type=int, default=64, help="calibration sequences of the importance pass")
    p.add_argument("--eval-text", default=str(EVAL_TEXT), help="held-out text scored by every arm (never trained on)")
    p.add_argument("--calib-text", default=str(CALIB_TEXT), help="calibration text of the importance pass")
    p.add_argument("--train-text", default=None,
                   help="training text (default: distill's default, the pydoc train split less every calibration "
                        "and eval document)")
    p.add_argument("--progress", action="store_true", help="progress bars (training, evaluation) on stderr")
    p.add_argument("--json", help="also write the results JSON here")


def main(args) -> int:
    try:
        tokens, families = parse_tokens(args.tokens), [f.strip() for f in args.arms.split(",") if f.strip()]
        seeds = [int(s) for s in args.seeds.split(",")]
        arms = plan_arms(families, tokens, seeds)
    except ValueError as exc:
        raise MinitronSettingsError(f"compress bench minitron: {exc}") from None
    if min(args.threads, args.kl_windows, args.batch_size, args.calib_samples, args.depth_layers) < 1:
        raise MinitronSettingsError("compress bench minitron: --threads, --kl-windows, --batch-size, "
                                    "--calib-samples and --depth-layers must be at least 1")
    teacher = Path(args.teacher).resolve()
    if not (teacher / "config.json").is_file():
        raise MinitronSettingsError(f"--teacher {teacher}: not a model directory (no config.json)")
    torch.set_num_threads(args.threads)
    texts = {}
    for option in ("eval_text", "calib_text", "train_text"):
        value = getattr(args, option)
        if value is not None and not Path(value).is_file():
            raise MinitronSettingsError(f"--{option.replace('_', '-')} {value}: file not found")
        texts[option] = None if value is None else str(Path(value).resolve())
    exp = Experiment(Path(args.out).resolve(), teacher, parse_targets(args.width_targets),
                     HealSettings(batch_size=args.batch_size, heal_lr=args.heal_lr, scratch_lr=args.scratch_lr),
                     args.threads, args.kl_windows, args.calib_samples, args.progress, depth_layers=args.depth_layers,
                     **texts)
    t0 = time.perf_counter()
    rows = [exp.run(arm) for arm in arms]
    result = summarize(rows, exp.settings(), time.perf_counter() - t0)
    text = json.dumps(result, indent=2)
    atomic_write_text(exp.out / "results.json", text + "\n")
    if args.json:
        atomic_write_text(args.json, text + "\n")
    atomic_write_text(exp.out / "results.md", result["markdown"])
    print(result["markdown"])
    print(f"wrote {exp.out / 'results.md'} and {exp.out / 'results.json'}")
    return 0


def summarize(rows: list[dict], settings: dict, seconds: float) -> dict:
    rows = add_recovery(rows)
    summary, goal_lines = seed_summary(rows), goals(rows)
    notes = [f"teacher {settings['teacher']}; eval text {settings['eval_text']} ({EVAL_SEQ_LEN}-token windows, "
             f"never trained on); KL / top-1 over its first {settings['kl_windows']} windows",
             f"width targets {settings['width_targets']}; depth: {settings['depth_layers']} blocks kept (Block "
             f"Importance); random: seeded "
             f"indices of the width shape; scratch: a random init of the width architecture",
             f"training: batch {settings['heal']['batch_size']} x {settings['heal']['seq_len']} tokens, AdamW, "
             f"warmup {settings['heal']['warmup']} then cosine to {settings['heal']['min_lr_ratio']}x; KD heal lr "
             f"{settings['heal']['heal_lr']} (wd {settings['heal']['heal_weight_decay']}), scratch lr "
             f"{settings['heal']['scratch_lr']} (wd {settings['heal']['scratch_weight_decay']}); the CE arms run "
             "the teacher's forward too (the distill step's loop), so their tok/s is the KD arms'",
             f"{settings['threads']} threads, niceness {settings['niceness']}: tok/s and seconds were measured "
             "alongside whatever else ran on the machine (load avg = 1-minute load average before-after the arm)",
             f"whole experiment this run: {seconds:.0f} s (arms reused from an earlier run count 0)"]
    return {"settings": settings, "rows": rows, "seed_spread": summary, "goals": goal_lines,
            "seconds": seconds, "markdown": markdown(rows, goal_lines, summary, notes)}


class Experiment:
    """Runs one arm at a time into ``out``; an arm whose result file holds the same
    settings is reused."""

    def __init__(self, out: Path, teacher: Path, width_targets: dict, heal: HealSettings, threads: int,
                 kl_windows: int, calib_samples: int, progress: bool, eval_text: str = str(EVAL_TEXT),
                 calib_text: str = str(CALIB_TEXT), train_text: str | None = None, depth_layers: int = DEPTH_LAYERS):
        self.out, self.teacher, self.width_targets, self.heal = out, teacher, width_targets, heal
        self.eval_text, self.calib_text, self.train_text = eval_text, calib_text, train_text
        self.depth_layers = depth_layers
        self.threads, self.kl_windows, self.calib_samples, self.progress = threads, kl_windows, calib_samples, progress
        self.models = out / "models"
        self.keys: dict[str, str] = {}
        self._kl_cache: dict | None = None

    def settings(self) -> dict:
        from dataclasses import asdict

        return {"teacher": str(self.teacher), "eval_text": self.eval_text, "calib_text": self.calib_text,
                "train_text": self.train_text or "distill's default (pydoc train split less calib/eval documents)",
                "width_targets": self.width_targets, "depth_layers": self.depth_layers, "heal": asdict(self.heal),
                "threads": self.threads, "kl_windows": self.kl_windows, "calib_samples": self.calib_samples,
                "niceness": os.nice(0),
                "torch": torch.__version__, "cpus": os.cpu_count()}

    def log(self, message: str) -> None:
        print(f"[minitron] {message}", flush=True)

    # --- one arm ------------------------------------------------------------------
    def plan(self, arm: Arm) -> dict:
        """What determines the arm's model: its recipe (or init), its start's key."""
        if arm.family == "teacher":
            return {"teacher": str(self.teacher)}
        if arm.start is None and arm.family == "scratch":
            return {"scratch_init": {"targets": self.width_targets, "seed": arm.seed, "teacher": str(self.teacher)}}
        if arm.start is None:
            return {"recipe": prune_recipe(arm, str(self.teacher), str(self.models), self.calib_text,
                                           self.width_targets, self.calib_samples, self.depth_layers)}
        return {"recipe": heal_recipe(arm, str(self.models / arm.start), str(self.teacher), str(self.models),
                                      self.heal, self.train_text),
                "start": self.keys[arm.start]}

    def run(self, arm: Arm) -> dict:
        plan = self.plan(arm)
        plan["eval"] = {"text": self.eval_text, "seq_len": EVAL_SEQ_LEN, "kl_windows": self.kl_windows}
        key = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
        self.keys[arm.name] = key
        record = self.out / "arms" / f"{arm.name}.json"
        path = self.teacher if arm.family == "teacher" else self.models / arm.name
        if record.is_file() and path.is_dir():
            saved = json.loads(record.read_text())
            if saved.get("key") == key:
                self.log(f"{arm.name}: reusing {record}")
                return saved["row"]
        self.log(f"{arm.name}: start (load average {os.getloadavg()[0]:.1f})")
        row = {"name": arm.name, "family": arm.family, "heal": arm.heal, "tokens": arm.tokens, "seed": arm.seed,
               "start": arm.start}
        load_before, started = os.getloadavg()[0], time.time()
        if "recipe" in plan:
            row.update(self.run_recipe(arm, plan["recipe"]))
        elif "scratch_init" in plan:
            write_scratch_init(self.teacher, path, self.width_targets, arm.seed)
        # wall-clock span of the arm's model work (to line up with other events on a shared machine)
        row["ran"] = [started, time.time()]
        row["loadavg"] = [load_before, os.getloadavg()[0]] if arm.trained else None
        row.update(self.evaluate(path, arm.name))
        atomic_write_text(record, json.dumps({"key": key, "plan": plan, "row": row}, indent=2) + "\n")
        self.log(f"{arm.name}: eval loss {row['eval_loss']:.4f} (ppl {row['perplexity']:.2f}), KL {row['kl']:.4f}, "
                 f"top-1 {row['top1']:.3f}, {row['parameters'] / 1e6:.2f}M parameters"
                 + (f"; {row['tokens_per_s']:.0f} tok/s, {row['train_seconds']:.0f} s training" if arm.trained else ""))
        return row

    def run_recipe(self, arm: Arm, doc: dict) -> dict:
        """Writes ``OUT/recipes/<arm>.yaml`` and runs it as ``compress run --no-eval`` does."""
        import yaml

        from compress.pipeline import compress_stages
        from compress.recipe import load_recipe

        recipe_path = self.out / "recipes" / f"{arm.name}.yaml"
        atomic_write_text(recipe_path, yaml.safe_dump(doc, sort_keys=False))
        recipe = load_recipe(recipe_path)
        _, results = compress_stages(recipe, self.models, progress=self.progress,
                                     log=lambda m: self.log(f"{arm.name}: {m}"))
        stage = results[0]
        out = {"stage_seconds": stage.seconds, "recipe": str(recipe_path)}
        distill = stage.stats.get("distill")
        if distill:
            out.update({"train_seconds": distill["seconds"], "tokens_per_s": distill["tokens_per_s"],
                        "steps": distill["steps"], "tokens_trained": distill["tokens"],
                        "held_out": distill["held_out"]})
        prune = stage.stats.get("prune")
        if prune:
            out["prune"] = {k: prune[k] for k in ("strategy", "after", "kept_blocks", "block_importance") if k in prune}
        return out

    # --- evaluation ---------------------------------------------------------------
    def eval_config(self):
        from evals.eval_config import EvalConfig, KLConfig, PerplexityConfig

        return EvalConfig(perplexity=PerplexityConfig(file=self.eval_text, seq_len=EVAL_SEQ_LEN, stride=EVAL_SEQ_LEN),
                          kl=KLConfig(file=self.eval_text, windows=self.kl_windows, seq_len=EVAL_SEQ_LEN),
                          speed=None, threads=self.threads, progress=self.progress)

    def kl_reference(self) -> dict:
        """The teacher's log-probs on the KL windows, built once per process (a reused
        teacher row must not make the first evaluated arm its own reference)."""
        if self._kl_cache is None:
            from evals.backend import load_llm
            from evals.kl import build_kl_reference

            cfg = self.eval_config()
            llm = load_llm(self.teacher, threads=self.threads)
            ref = build_kl_reference(llm, cfg.kl.file, windows=cfg.kl.windows, seq_len=EVAL_SEQ_LEN,
                                     progress=self.progress)
            self._kl_cache = {"reference": ref}
        return self._kl_cache

    def evaluate(self, path: Path, name: str) -> dict:
        from evals.evaluate import evaluate_checkpoint

        rec = evaluate_checkpoint(path, self.eval_config(), self.kl_reference(), name=name)
        if rec.get("errors"):
            cell, err = next(iter(rec["errors"].items()))
            raise RuntimeError(f"evaluating {name} ({path}) failed in {cell}: {err['message']}")
        return {"parameters": rec["parameters"], "eval_loss": rec["nll"] / rec["perplexity_tokens"],
                "perplexity": rec["perplexity"], "eval_tokens": rec["perplexity_tokens"], "kl": rec["kl_to_base"],
                "top1": rec["top1_agreement"], "kl_tokens": rec["kl_tokens"], "path": str(path)}


def scratch_config(teacher: Path, width_targets: dict):
    """The width arm's architecture (the teacher's config at the pruned sizes, head_dim kept)."""
    from transformers import AutoConfig

    from pruning.channel_slices import attention_shape, smaller_config
    from pruning.prune import PruneTargets, target_shape

    config = AutoConfig.from_pretrained(teacher)
    shape = target_shape(config, PruneTargets(**width_targets), "--width-targets")
    return smaller_config(config, {**shape.__dict__, "head_dim": attention_shape(config)[2]})


def write_scratch_init(teacher: Path, path: Path, width_targets: dict, seed: int) -> None:
    """A random init (the config's initializer, seeded) of the width architecture with
    the teacher's tokenizer, as an HF directory written atomically."""
    import shutil

    from transformers import AutoModelForCausalLM

    from compress.io.files import atomic_dir

    config = scratch_config(teacher, width_targets)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with atomic_dir(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for f in teacher.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens_map", "generation_config")):
                shutil.copyfile(f, tmp / f.name)


if __name__ == "__main__":  # pragma: no cover
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
