"""Recipe parsing: defaults, stages, ordering, teachers, training data, and errors that
name the file, the step and the key."""
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from compress import registry
from compress.config import ConfigError
from compress.recipe import TeacherRef, load_recipe, parse_recipe
from quantizers.rtn import RTNConfig


def write(tmp_path: Path, doc) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return p


BASE = {"model": {"path": "m"}, "steps": [{"method": "rtn", "bits": 8}]}


def test_shorthand_steps_make_one_stage(tmp_path):
    r = load_recipe(write(tmp_path, BASE))
    assert [s.name for s in r.stages] == ["r"]
    step = r.stages[0].steps[0]
    assert isinstance(step.config, RTNConfig) and step.config.bits == 8 and step.config.group_size == 128


def test_stages_chain_and_paths_resolve_against_recipe(tmp_path):
    doc = {"model": {"path": "m"}, "calibration": {"files": ["c.txt"]},
           "stages": [{"name": "a", "steps": [{"method": "rtn", "bits": 8}]},
                      {"name": "b", "from": "a", "steps": [{"method": "rtn", "bits": 4, "group_size": 64}]}]}
    r = load_recipe(write(tmp_path, doc))
    assert [(s.name, s.source) for s in r.stages] == [("a", "base"), ("b", "a")]
    assert r.resolve("c.txt") == str((tmp_path / "c.txt").resolve())
    resolved = yaml.safe_load(r.resolved_yaml())
    assert resolved["stages"][1]["steps"][0] == {**resolved["stages"][1]["steps"][0], "group_size": 64, "bits": 4}
    assert resolved["calibration"]["files"] == [str((tmp_path / "c.txt").resolve())]


@pytest.mark.parametrize("doc, fragments", [
    ({**BASE, "steps": [{"method": "nope"}]}, ["r.yaml", "step 1", "method", "unknown method 'nope'", "rtn"]),
    ({**BASE, "steps": [{"method": "rtn", "bitz": 4}]}, ["step 1 (rtn).bitz", "unknown key 'bitz'"]),
    ({**BASE, "steps": [{"method": "rtn", "bits": 3}]}, ["step 1 (rtn).bits", "must be one of [4, 8]"]),
    ({**BASE, "steps": [{"method": "rtn", "group_size": 100}]}, ["group_size", "multiple of 8"]),
    ({**BASE, "steps": [{"method": "rtn", "group_size": "big"}]}, ["group_size", "must be a positive multiple of 8", "got 'big'"]),
    ({**BASE, "calibration": {"samples": 0}}, ["calibration.samples", "must be > 0"]),
    ({**BASE, "calibration": {"sample": 3}}, ["calibration.sample", "unknown key"]),
    ({**BASE, "extra": 1}, ["unknown top-level key 'extra'"]),
    ({"steps": BASE["steps"]}, ["missing required section 'model'"]),
    ({"model": {"path": "m"}}, ["exactly one of 'steps'"]),
    ({"model": {"path": "m"}, "steps": []}, ["non-empty list"]),
    ({"model": {"path": "m"}, "stages": [{"name": "a", "from": "zzz", "steps": BASE["steps"]}]}, ["stage 1.from", "zzz"]),
    ({"model": {"path": "m"}, "stages": [{"name": "base", "steps": BASE["steps"]}]}, ["not 'base'"]),
    ({"model": {"path": "m"}, "stages": [{"name": "a", "steps": BASE["steps"]}, {"name": "a", "steps": BASE["steps"]}]},
     ["duplicate stage name 'a'"]),
    ({**BASE, "eval": {"kernels": "fast"}}, ["eval.kernels: must be one of"]),
])
def test_bad_recipes_name_file_step_and_key(tmp_path, doc, fragments):
    with pytest.raises(ConfigError) as err:
        load_recipe(write(tmp_path, doc))
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))


def test_malformed_yaml_reports_line(tmp_path):
    with pytest.raises(ConfigError, match=r"r.yaml:\d+:\d+: malformed YAML: expected"):
        load_recipe(write(tmp_path, "model:\n  path: [unclosed\n"))


def test_missing_recipe_file(tmp_path):
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_recipe(tmp_path / "absent.yaml")


def test_shipped_examples_parse(repo_root):
    for p in sorted((repo_root / "examples").glob("*.yaml")):
        r = parse_recipe(yaml.safe_load(p.read_text()), p)
        assert r.stages


# --- ordering and teachers: a dummy transform method registered for the test only ---


@dataclass
class DummyTransformConfig:
    strength: float = 1.0


@pytest.fixture
def dummy_transform(monkeypatch):
    def never(*_args):
        raise AssertionError("not run by the parser")

    monkeypatch.setitem(registry.METHODS, "shrink", registry.Method(
        "shrink", DummyTransformConfig, never, never, False, "a test transform", kind="transform",
        uses_teacher=True))


def stages_doc(*stages) -> dict:
    return {"model": {"path": "m"}, "stages": [
        {"name": name, **({"from": source} if source else {}), "steps": [{"method": m, **kw} for m, kw in steps]}
        for name, source, steps in stages]}


RTN = ("rtn", {"bits": 8})
SHRINK = ("shrink", {})


def test_builtin_methods_declare_their_kind():
    assert {name: m.kind for name, m in registry.METHODS.items()} == {
        "rtn": "quantize", "llm_int8": "quantize", "awq": "quantize", "prune": "transform",
        "distill": "transform"}


@pytest.mark.parametrize("stages", [
    [("a", None, [SHRINK, RTN])],                                   # transform, then quantize
    [("a", None, [RTN]), ("b", None, [SHRINK, RTN])],               # b starts from base: a float chain
    [("a", None, [SHRINK]), ("b", "a", [SHRINK]), ("c", "b", [RTN])],
])
def test_transforms_before_quantizing_parse(tmp_path, dummy_transform, stages):
    r = load_recipe(write(tmp_path, stages_doc(*stages)))
    assert [s.method for s in r.stages[-1].steps] == [m for m, _ in stages[-1][2]]


@pytest.mark.parametrize("stages, fragments", [
    ([("a", None, [RTN, SHRINK])], ["stage 'a' step 2 (shrink)", "stage 'a' step 1 (rtn) has quantized"]),
    ([("a", None, [RTN]), ("b", "a", [SHRINK])], ["stage 'b' step 1 (shrink)", "stage 'a' step 1 (rtn)"]),
    ([("a", None, [SHRINK, RTN]), ("b", "a", [("rtn", {"bits": 4})]), ("c", "b", [SHRINK])],
     ["stage 'c' step 1 (shrink)", "stage 'a' step 2 (rtn)"]),
])
def test_transform_after_quantizing_is_refused(tmp_path, dummy_transform, stages, fragments):
    with pytest.raises(ConfigError) as err:
        load_recipe(write(tmp_path, stages_doc(*stages)))
    msg = str(err.value)
    assert msg.startswith(str(tmp_path / "r.yaml")) and "transforms the float model" in msg
    for f in fragments:
        assert f in msg, (f, msg)


def test_teacher_defaults_to_the_stage_source(tmp_path, dummy_transform):
    r = load_recipe(write(tmp_path, stages_doc(("a", None, [SHRINK]), ("b", "a", [SHRINK, RTN]))))
    assert [s.teacher for st in r.stages for s in st.steps] == [
        TeacherRef(stage="base"), TeacherRef(stage="a"), TeacherRef(stage="a")]
    assert r.stages[1].steps[0].teacher.directory("/models/base", tmp_path / "out") == str(tmp_path / "out" / "a")
    assert r.stages[0].steps[0].teacher.directory("/models/base", tmp_path / "out") == "/models/base"


def test_teacher_names_an_earlier_stage_or_a_directory(tmp_path, dummy_transform):
    (tmp_path / "big-model").mkdir()
    doc = stages_doc(("a", None, [SHRINK]), ("b", "a", [("shrink", {"teacher": "base"})]),
                     ("c", "b", [("shrink", {"teacher": "a"}), ("shrink", {"teacher": "big-model", "strength": 2})]))
    r = load_recipe(write(tmp_path, doc))
    c = r.stages[2].steps
    assert r.stages[1].steps[0].teacher == TeacherRef(stage="base")
    assert c[0].teacher == TeacherRef(stage="a") and c[1].config.strength == 2
    assert c[1].teacher == TeacherRef(path=str((tmp_path / "big-model").resolve()))
    assert c[1].teacher.directory("/b", "/out") == str((tmp_path / "big-model").resolve())
    resolved = yaml.safe_load(r.resolved_yaml())
    assert [s["teacher"] for s in resolved["stages"][2]["steps"]] == ["a", str((tmp_path / "big-model").resolve())]
    again = parse_recipe(resolved, tmp_path / "elsewhere.yaml")
    assert [s.teacher for st in again.stages for s in st.steps] == [s.teacher for st in r.stages for s in st.steps]


@pytest.mark.parametrize("teacher, fragments", [
    ("b", ["stage 'b' step 1 (shrink).teacher", "teacher 'b' names no earlier stage (base, a)", "does not exist"]),
    ("later", ["names no earlier stage (base, a)"]),
    ("notes.txt", ["is a file, not a model directory"]),
    (3, ["'teacher' must be a stage name or a model directory, got 3"]),
])
def test_bad_teacher_is_named(tmp_path, dummy_transform, teacher, fragments):
    (tmp_path / "notes.txt").write_text("x")
    doc = stages_doc(("a", None, [SHRINK]), ("b", "a", [("shrink", {"teacher": teacher})]), ("later", "a", [SHRINK]))
    with pytest.raises(ConfigError) as err:
        load_recipe(write(tmp_path, doc))
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))


def test_a_method_without_a_teacher_refuses_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"step 1 \(rtn\)\.teacher: unknown key 'teacher' for RTNConfig"):
        load_recipe(write(tmp_path, {**BASE, "steps": [{"method": "rtn", "teacher": "base"}]}))


# --- the training section ---

def test_training_section_is_optional_and_resolved(tmp_path):
    assert load_recipe(write(tmp_path, BASE)).training is None
    r = load_recipe(write(tmp_path, {**BASE, "training": {"files": ["t.jsonl"], "field": "body", "tokens": 4096,
                                                          "seq_len": 128, "seed": 3}}))
    t = r.training
    assert (t.files, t.field, t.dataset, t.tokens, t.seq_len, t.seed) == (["t.jsonl"], "body", None, 4096, 128, 3)
    resolved = yaml.safe_load(r.resolved_yaml())
    assert resolved["training"]["files"] == [str((tmp_path / "t.jsonl").resolve())]
    assert "training" not in yaml.safe_load(load_recipe(write(tmp_path, BASE)).resolved_yaml())
    assert parse_recipe(resolved, tmp_path / "again.yaml").training.files == resolved["training"]["files"]


@pytest.mark.parametrize("training, fragments", [
    ({}, ["training.files", "needs data"]),
    ({"dataset": "wikitext:wikitext-2-raw-v1:train", "seq_len": 1}, ["training.seq_len", "must be > 1"]),
    ({"files": ["t.txt"], "tokens": 100, "seq_len": 256}, ["training.tokens", "at least seq_len (256)"]),
    ({"files": ["t.txt"], "samples": 3}, ["training.samples", "unknown key 'samples' for TrainingConfig"]),
    ({"files": "t.txt"}, ["training.files", "expected a list"]),
])
def test_bad_training_sections_are_named(tmp_path, training, fragments):
    with pytest.raises(ConfigError) as err:
        load_recipe(write(tmp_path, {**BASE, "training": training}))
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))
