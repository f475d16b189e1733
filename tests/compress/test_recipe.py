"""Recipe parsing: defaults, stages, and errors that name the file, the step and the key."""
from pathlib import Path

import pytest
import yaml

from compress.config import ConfigError
from compress.recipe import load_recipe, parse_recipe
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
