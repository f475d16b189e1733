"""Tiny distillation recipes for tests: a sharp random teacher, a perturbed student, a
recipe with a distill stage run through compress_stages."""
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM

from compress.pipeline import compress_stages
from compress.recipe import load_recipe
from tiny_models import corpus_text, make_tiny_model

QUIET = dict(progress=False, log=lambda *_: None)


def text_ids():
    """Windows of the training text (the distribution the student is trained on)."""
    from tiny_models import make_tokenizer

    ids = make_tokenizer()(corpus_text())["input_ids"]
    return torch.tensor(ids[:8 * 32]).view(8, 32)


def perturbed_copy(teacher_dir: Path, path: Path, scale: float = 0.5, seed: int = 1) -> Path:
    """The teacher with noise on every matrix: a student that differs from it."""
    model = AutoModelForCausalLM.from_pretrained(teacher_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    model.save_pretrained(path)
    for f in teacher_dir.glob("tokenizer*"):
        (path / f.name).write_bytes(f.read_bytes())
    for f in teacher_dir.glob("special_tokens_map.json"):
        (path / f.name).write_bytes(f.read_bytes())
    return path


def sharp_teacher(path: Path, **kw) -> Path:
    """A tiny random model with a scaled-up head: peaked next-token distributions (a
    random init's are nearly uniform, and so are its KLs)."""
    make_tiny_model(path, "llama", **kw)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(6)
    model.save_pretrained(path)
    return path


def write_recipe(tmp_path: Path, student: Path, teacher: Path | None, distill: dict | None = None,
                 training: dict | None = "default", name: str = "recipe.yaml") -> Path:
    (tmp_path / "train.txt").write_text(corpus_text())
    step = {"method": "distill", "batch_size": 2, "lr": 3e-4, "warmup": 0.1, "eval_every": 0,
            "held_out_windows": 2, "checkpoint_every": 0, **(distill or {})}
    if teacher is not None:
        step["teacher"] = str(teacher)
    doc = {"name": "t", "model": {"path": str(student)},
           "calibration": {"files": ["train.txt"], "samples": 2, "seq_len": 16},
           "stages": [{"name": "healed", "steps": [step]}], "export": {"output": "out"}}
    if training == "default":
        training = {"files": ["train.txt"], "tokens": 32 * 2 * 16, "seq_len": 32}
    if training is not None:
        doc["training"] = training
    (tmp_path / name).write_text(yaml.safe_dump(doc))
    return tmp_path / name


def run(recipe_path: Path, out: Path, **kw):
    _, results = compress_stages(load_recipe(recipe_path), out, **{**QUIET, **kw})
    return results[0]


def kl(teacher, student) -> float:
    with torch.no_grad():
        ids = text_ids()
        p, q = teacher(ids).logits.log_softmax(-1), student(ids).logits.log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
