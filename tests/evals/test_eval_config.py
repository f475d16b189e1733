"""Evaluation settings sized to the model's context; values it cannot take are
ConfigErrors naming the recipe key, caught by ``compress run --dry-run``."""
import pytest
import yaml

from compress.cli import main
from compress.config import ConfigError
from compress.recipe import load_recipe
from evals.eval_config import EvalConfig, check_eval_against_context


def test_defaults_follow_the_context():
    short = EvalConfig().for_context(128)
    assert (short.perplexity.seq_len, short.perplexity.stride) == (128, 64)
    assert short.kl.seq_len == 128
    assert (short.speed.prompt_len, short.speed.new_tokens) == (64, 64)
    for long in (EvalConfig().for_context(4096), EvalConfig().for_context(None)):
        assert (long.perplexity.seq_len, long.perplexity.stride) == (512, 256)
        assert long.kl.seq_len == 256
        assert (long.speed.prompt_len, long.speed.new_tokens) == (128, 64)
    tiny = EvalConfig.from_dict({"speed": {"prompt_len": 10}}).for_context(16)
    assert (tiny.speed.prompt_len, tiny.speed.new_tokens) == (10, 6)
    explicit = EvalConfig.from_dict({"perplexity": {"seq_len": 100}}).for_context(128)
    assert (explicit.perplexity.seq_len, explicit.perplexity.stride) == (100, 50)


def test_no_tasks_unless_asked():
    assert EvalConfig().tasks == [] and EvalConfig.from_dict({}).tasks == []


@pytest.mark.parametrize("section, key", [
    ({"perplexity": {"stride": 256}}, "perplexity.stride"),             # default seq_len is 128 here
    ({"perplexity": {"seq_len": 256}}, "perplexity.seq_len"),
    ({"kl": {"seq_len": 256}}, "kl.seq_len"),
    ({"speed": {"prompt_len": 128}}, "speed.prompt_len"),
    ({"speed": {"new_tokens": 128}}, "speed.new_tokens"),
    ({"speed": {"prompt_len": 100, "new_tokens": 64}}, "speed.prompt_len"),
])
def test_values_the_context_cannot_take_name_their_key(section, key):
    cfg = EvalConfig.from_dict(section)
    check_eval_against_context(cfg, 4096, where="r.yaml: eval")
    with pytest.raises(ConfigError) as err:
        check_eval_against_context(cfg, 128, where="r.yaml: eval")
    assert err.value.where == f"r.yaml: eval.{key}" and "128" in str(err.value)


@pytest.mark.parametrize("section, key", [
    ({"perplexity": {"seq_len": 64, "stride": 65}}, "perplexity.stride"),
    ({"perplexity": {"seq_len": 1}}, "perplexity.seq_len"),
    ({"kl": {"windows": 0}}, "kl.windows"),
    ({"speed": {"repeats": 0}}, "speed.repeats"),
])
def test_impossible_values_fail_when_the_recipe_is_read(tmp_path, tiny_model_dir, section, key):
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({"model": {"path": str(tiny_model_dir)},
                                 "steps": [{"method": "rtn", "bits": 8}], "eval": section}))
    with pytest.raises(ConfigError) as err:
        load_recipe(p)
    assert err.value.where == f"{p}: eval.{key}"


def _recipe(tmp_path, model_dir, eval_section):
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({"name": "short", "model": {"path": str(model_dir)},
                                 "steps": [{"method": "rtn", "bits": 8}], "eval": eval_section}))
    return p


def test_dry_run_catches_a_stride_the_context_cannot_take(tmp_path, tiny_model_dir, capsys):
    """The tiny model's context is 128 tokens: the default perplexity windows are 128 long."""
    assert main(["run", str(_recipe(tmp_path, tiny_model_dir, {"perplexity": {"stride": 256}})),
                 "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "r.yaml: eval.perplexity.stride: 256 is longer than seq_len 128" in err
    assert "Traceback" not in err
    assert main(["run", str(_recipe(tmp_path, tiny_model_dir, {"kl": {"seq_len": 512}})), "--dry-run"]) == 2
    assert "r.yaml: eval.kl.seq_len: 512 is longer than the model's context of 128" in capsys.readouterr().err
    assert main(["run", str(_recipe(tmp_path, tiny_model_dir, {"perplexity": {"file": "missing.txt"}})),
                 "--dry-run"]) == 2
    assert "eval.perplexity.file: evaluation text not found" in capsys.readouterr().err
    assert main(["run", str(_recipe(tmp_path, tiny_model_dir, {})), "--dry-run"]) == 0


def test_int4_activation_precision_is_a_checked_setting():
    assert EvalConfig().w4_activations == "float"
    assert EvalConfig.from_dict({"w4_activations": "int8"}).w4_activations == "int8"
    with pytest.raises(ConfigError, match="eval.w4_activations"):
        EvalConfig.from_dict({"w4_activations": "int4"})
