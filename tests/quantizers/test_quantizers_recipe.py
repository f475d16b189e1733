"""End to end through the recipe layer: parse a recipe with awq and llm_int8 stages, run
``compress_stages`` on a tiny model saved to disk, load the exported checkpoints back."""
import pytest
import torch
import yaml

from compress.config import ConfigError
from compress.recipe import parse_recipe
from quantizers.awq import AWQConfig
from quantizers.llm_int8 import LLMInt8Config
from tiny_models import corpus_text, make_tiny_model

pytestmark = pytest.mark.slow


def _recipe(tmp_path, stages):
    (tmp_path / "calib.txt").write_text(corpus_text())
    doc = {"name": "tiny-quantizers", "model": {"path": "model"},
           "calibration": {"files": ["calib.txt"], "samples": 4, "seq_len": 32},
           "stages": stages, "export": {"output": "out"}}
    return parse_recipe(doc, tmp_path / "recipe.yaml")


def test_awq_and_llm_int8_stages_export_and_load(tmp_path):
    from compress.io.checkpoint import load_checkpoint
    from compress.pipeline import compress_stages

    make_tiny_model(tmp_path / "model", "llama")
    recipe = _recipe(tmp_path, [
        {"name": "awq-int4", "steps": [{"method": "awq", "group_size": 64, "n_grid": 4, "clip_grid": 4}]},
        {"name": "llm-int8", "steps": [{"method": "llm_int8", "threshold": 2.0}]},
    ])
    assert isinstance(recipe.stages[0].steps[0].config, AWQConfig)
    assert isinstance(recipe.stages[1].steps[0].config, LLMInt8Config)
    _, results = compress_stages(recipe, tmp_path / "out", progress=False, log=lambda *a: None)
    assert [r.name for r in results] == ["awq-int4", "llm-int8"]
    awq = load_checkpoint(results[0].path)
    assert len(awq.quantized) == 14 and set(awq.schemes.values()) == {"w4a16"}
    int8 = load_checkpoint(results[1].path)
    assert set(int8.schemes.values()) == {"llm_int8"}
    qw = int8.quantized["model.layers.0.mlp.down_proj"]
    assert qw.tensors["outlier_weight"].shape == (qw.tensors["qweight"].shape[0], qw.tensors["outlier_idx"].numel())


@pytest.mark.parametrize("step, fragment", [
    ({"method": "llm_int8", "threshold": 0}, "stage 'x' step 1 (llm_int8).threshold"),
    ({"method": "awq", "group_size": 100}, "stage 'x' step 1 (awq).group_size"),
    ({"method": "awq", "grid": 10}, "unknown key 'grid'"),
])
def test_recipe_errors_name_stage_step_and_key(tmp_path, step, fragment):
    with pytest.raises(ConfigError) as info:
        _recipe(tmp_path, [{"name": "x", "steps": [step]}])
    assert fragment in str(info.value) and "recipe.yaml" in str(info.value)


def test_group_size_not_dividing_in_features_names_step_and_layer(tmp_path):
    from compress.errors import StepError
    from compress.pipeline import compress_stages

    make_tiny_model(tmp_path / "model", "llama")        # in_features 128 and 256
    recipe = _recipe(tmp_path, [{"name": "awq-96", "steps": [{"method": "awq", "group_size": 96}]}])
    with pytest.raises(StepError, match=r"stage 'awq-96' step 1 \(awq\).*model\.layers\.0\.self_attn\.q_proj.*"
                                        r"not divisible by group_size 96"):
        compress_stages(recipe, tmp_path / "out", progress=False, log=lambda *a: None)
    assert not (tmp_path / "out" / "awq-96").exists()
