"""``compress run --dry-run`` checks a step's group size against the model's shapes from
its config.json alone (no weights; ``quantizers/shape_checks.py`` via ``Method.check_model``)."""
import pytest
import yaml

from compress.cli import main
from compress.config import ConfigError
from compress.preflight import meta_model
from quantizers.awq import AWQConfig
from quantizers.llm_int8 import LLMInt8Config
from quantizers.rtn import RTNConfig
from quantizers.shape_checks import check_int4_group_size, check_targets
from tiny_models import tiny_config

WHERE = "r.yaml: stage 'int4' step 1 (rtn)"


@pytest.fixture(scope="module")
def mlp_172():
    return meta_model(tiny_config("llama", intermediate_size=172))


@pytest.mark.parametrize("config", [RTNConfig(group_size=128), AWQConfig(group_size=64)], ids=["rtn", "awq"])
def test_indivisible_shape_names_step_key_layer_and_in_features(mlp_172, config):
    with pytest.raises(ConfigError) as info:
        check_int4_group_size(mlp_172, config, WHERE)
    message = str(info.value)
    assert message.startswith(WHERE + ".group_size: ")
    assert "'model.layers.0.mlp.down_proj': in_features 172" in message
    assert "group_size: channel" in message and "ignore" in message
    assert "(nor is 1 more layer's)" in message    # layers.1.mlp.down_proj


@pytest.mark.parametrize("config", [RTNConfig(group_size="channel"), RTNConfig(group_size=-1), RTNConfig(bits=8),
                                    RTNConfig(group_size=128, ignore=["*down_proj"]), AWQConfig(group_size=-1)])
def test_shapes_that_fit_pass(mlp_172, config):
    check_int4_group_size(mlp_172, config, WHERE)


def test_target_patterns_are_checked_on_the_meta_model(mlp_172):
    with pytest.raises(ConfigError, match=r"\(llm_int8\)\.ignore: pattern '\*o_prj' matches no linear"):
        check_targets(mlp_172, LLMInt8Config(ignore=["*o_prj"]), "r.yaml: step 1 (llm_int8)")


def _config_only_model(tmp_path, group_size):
    model = tmp_path / "model"
    model.mkdir()
    tiny_config("llama", intermediate_size=172).save_pretrained(model)   # config.json, no weights
    recipe = {"name": "per-channel", "model": {"path": "model"},
              "stages": [{"name": "int4", "steps": [{"method": "rtn", "bits": 4, "group_size": group_size}]}],
              "export": {"output": "out"}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_dry_run_catches_indivisible_shape_without_weights(tmp_path, capsys):
    recipe = _config_only_model(tmp_path, 128)
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json"]
    assert main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "stage 'int4' step 1 (rtn).group_size" in err
    assert "'model.layers.0.mlp.down_proj': in_features 172 is not divisible by group_size 128" in err
    assert "group_size: channel" in err and "Traceback" not in err


@pytest.mark.parametrize("spelling", ["channel", -1])
def test_dry_run_passes_per_channel(tmp_path, capsys, spelling):
    recipe = _config_only_model(tmp_path, spelling)
    assert main(["run", str(recipe), "--dry-run"]) == 0
    assert "OK" in capsys.readouterr().out
