"""``method: distill`` through real recipes (compress_stages): a perturbed student
moves towards its teacher; bad input (vocabulary, empty data, NaN loss, quantized
source, resume under another recipe) is a clear error naming the step."""
import json

import pytest
import torch
import yaml

from compress.errors import StepError
from compress.recipe import load_recipe
from distill_recipes import kl, load, run, write_recipe
from tiny_models import make_tiny_model



@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Many tiny ops (see tests/conftest.py::one_thread)."""


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


def test_a_tied_head_is_trained_and_written_once(tmp_path):
    from distill_recipes import perturbed_copy, sharp_teacher

    teacher = sharp_teacher(tmp_path / "teacher", tie_word_embeddings=True)
    student = perturbed_copy(teacher, tmp_path / "student")
    run(write_recipe(tmp_path, student, teacher, {"tokens": 32 * 2 * 3, "seq_len": 32}), tmp_path / "out")
    from safetensors.torch import load_file

    written = load_file(next((tmp_path / "out" / "healed").glob("*.safetensors")))
    assert "lm_head.weight" not in written
    healed = load(tmp_path / "out" / "healed")
    assert healed.lm_head.weight.data_ptr() == healed.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(written["model.embed_tokens.weight"], load(student).model.embed_tokens.weight)
