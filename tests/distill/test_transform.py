"""``method: distill`` through real recipes (compress_stages): a perturbed student
moves towards its teacher; bad input (vocabulary, empty data, NaN loss, quantized
source, resume under another recipe) is a clear error naming the step."""
import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from compress.errors import StepError
from compress.pipeline import compress_stages
from compress.recipe import load_recipe
from tiny_models import corpus_text, make_tiny_model

QUIET = dict(progress=False, log=lambda *_: None)


def text_ids():
    """Windows of the training text (the distribution the student is trained on)."""
    from tiny_models import make_tokenizer

    ids = make_tokenizer()(corpus_text())["input_ids"]
    return torch.tensor(ids[:8 * 32]).view(8, 32)


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Many tiny ops (see tests/conftest.py::one_thread)."""


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


@pytest.fixture
def models(tmp_path):
    teacher = sharp_teacher(tmp_path / "teacher")
    return teacher, perturbed_copy(teacher, tmp_path / "student")


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


def test_distill_moves_the_student_towards_the_teacher(models, tmp_path):
    teacher_dir, student_dir = models
    result = run(write_recipe(tmp_path, student_dir, teacher_dir, {"eval_every": 4}), tmp_path / "out")
    stats = result.stats["distill"]
    teacher, before, after = load(teacher_dir), load(student_dir), load(tmp_path / "out" / "healed")
    assert kl(teacher, after) < 0.8 * kl(teacher, before)
    assert stats["steps"] == 16 and stats["tokens"] == 16 * 2 * 32 and stats["resumed_from_step"] is None
    assert [h["step"] for h in stats["held_out"]] == [0, 4, 8, 12, 16]
    assert stats["held_out"][-1]["kl"] < 0.9 * stats["held_out"][0]["kl"]
    assert not (tmp_path / "out" / "healed.distill-checkpoints").exists()     # removed when complete
    assert after.config.to_dict()["hidden_size"] == 128


def test_losses_mix_top_k_hidden_and_bf16_teacher_run(models, tmp_path):
    teacher_dir, student_dir = models
    result = run(write_recipe(tmp_path, student_dir, teacher_dir,
                              {"loss": {"forward_kl": 1.0, "reverse_kl": 0.5, "ce": 0.1, "hidden": 0.5},
                               "top_k": 16, "temperature": 2.0, "teacher_dtype": "bfloat16"}), tmp_path / "out")
    teacher, before, after = load(teacher_dir), load(student_dir), load(tmp_path / "out" / "healed")
    assert kl(teacher, after) < kl(teacher, before)
    held_out = result.stats["distill"]["held_out"]
    assert held_out[-1]["kl"] < held_out[0]["kl"]


def test_teacher_with_another_vocabulary_is_refused_before_any_work(tmp_path):
    student = make_tiny_model(tmp_path / "student", "llama")
    teacher = make_tiny_model(tmp_path / "teacher", "llama", vocab_size=640)
    with pytest.raises(StepError, match=r"vocabulary of 640 tokens and the student 512"):
        run(write_recipe(tmp_path, student, teacher), tmp_path / "out")
    assert not (tmp_path / "out" / "healed").exists()


def test_empty_training_data_is_an_error_naming_the_step_and_file(models, tmp_path):
    teacher_dir, student_dir = models
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    recipe = write_recipe(tmp_path, student_dir, teacher_dir,
                          training={"files": ["empty.txt"], "tokens": 256, "seq_len": 32})
    with pytest.raises(StepError, match=r"stage 'healed' step 1 \(distill\).*training set is empty.*empty.txt"):
        run(recipe, tmp_path / "out")
    assert not (tmp_path / "out" / "healed").exists()


def test_no_training_data_is_refused_by_the_recipe(models, tmp_path):
    from compress.config import ConfigError

    teacher_dir, student_dir = models
    with pytest.raises(ConfigError, match="training section needs data"):
        load_recipe(write_recipe(tmp_path, student_dir, teacher_dir, training={"tokens": 256}))


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(models, tmp_path):
    teacher_dir, student_dir = models
    recipe = write_recipe(tmp_path, student_dir, teacher_dir,
                          {"lr": 1e30, "warmup": 0.0, "grad_clip": 0.0, "checkpoint_every": 1})
    with pytest.raises(StepError, match=r"step 1 \(distill\): the distillation loss is nan.* at step (\d+) of 16"
                                        r".*last good checkpoint \(step \d+\) stays in") as err:
        run(recipe, tmp_path / "out")
    ckpts = tmp_path / "out" / "healed.distill-checkpoints"
    kept = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-"))
    assert len(kept) == 1
    state = json.loads((ckpts / kept[0] / "state.json").read_text())
    assert all(torch.isfinite(torch.tensor(state["meta"]["losses"])))
    assert not (tmp_path / "out" / "healed").exists()


@pytest.mark.parametrize("role", ["teacher", "student"])
def test_a_quantized_teacher_or_student_is_refused(models, role, tmp_path):
    teacher_dir, student_dir = models
    doc = yaml.safe_load(write_recipe(tmp_path, teacher_dir, None).read_text())
    doc["stages"] = [{"name": "q", "steps": [{"method": "rtn", "bits": 8}]}]
    (tmp_path / "rtn.yaml").write_text(yaml.safe_dump(doc))
    run(tmp_path / "rtn.yaml", tmp_path / "quantized")
    quantized = tmp_path / "quantized" / "q"
    recipe = (write_recipe(tmp_path, student_dir, quantized) if role == "teacher"
              else write_recipe(tmp_path, quantized, teacher_dir))
    with pytest.raises(StepError, match=rf"step 1 \(distill\): the {role if role == 'teacher' else 'source'} "
                                        rf"{quantized} holds quantized layers"):
        run(recipe, tmp_path / "out")


def test_without_a_training_section_the_default_pydoc_text_is_used(models, tmp_path):
    teacher_dir, student_dir = models
    result = run(write_recipe(tmp_path, student_dir, teacher_dir, {"tokens": 32 * 2 * 2, "seq_len": 32},
                              training=None), tmp_path / "out")
    stats = result.stats["distill"]
    assert stats["default_text"] and stats["steps"] == 2 and stats["seq_len"] == 32
