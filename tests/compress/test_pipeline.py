"""compress_stages end to end on a tiny model: stages, chaining, export, errors."""
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from compress.errors import StepError
from compress.io.checkpoint import load_checkpoint
from compress.pipeline import compress_stages
from compress.recipe import load_recipe


def recipe_file(tmp_path: Path, model_dir: Path, stages, **extra) -> Path:
    (tmp_path / "calib.txt").write_text("Return the sum of the values in the list. " * 200)
    doc = {"name": "t", "model": {"path": str(model_dir)},
           "calibration": {"files": ["calib.txt"], "samples": 4, "seq_len": 32},
           "stages": stages, "export": {"output": "out"}, **extra}
    p = tmp_path / "recipe.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def test_rtn_stages_export_and_reload(tmp_path, tiny_llama_dir):
    stages = [{"name": "int8", "steps": [{"method": "rtn", "bits": 8}]},
              {"name": "int4", "steps": [{"method": "rtn", "bits": 4, "group_size": 64}]},
              {"name": "int4-then", "from": "int4", "steps": [{"method": "rtn", "bits": 8, "targets": ["*lm_head"]}]}]
    recipe = load_recipe(recipe_file(tmp_path, tiny_llama_dir, stages))
    base_dir, results = compress_stages(recipe, tmp_path / "out", progress=False, log=lambda *_: None)
    assert [r.name for r in results] == ["int8", "int4", "int4-then"]
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    n_block_linears = 7 * base.config.num_hidden_layers

    int8 = load_checkpoint(tmp_path / "out" / "int8")
    assert {q.scheme for q in int8.quantized.values()} == {"w8a8"} and len(int8.quantized) == n_block_linears
    int4 = load_checkpoint(tmp_path / "out" / "int4")
    assert {q.scheme for q in int4.quantized.values()} == {"w4a16"}
    assert all(q.meta["group_size"] == 64 for q in int4.quantized.values())
    chained = load_checkpoint(tmp_path / "out" / "int4-then")
    assert chained.quantized["lm_head"].scheme == "w8a8"
    assert chained.quantized["model.layers.0.mlp.down_proj"].scheme == "w4a16"
    # the chained stage starts from int4's weights, not the base's
    for name in ("model.layers.1.self_attn.q_proj",):
        torch.testing.assert_close(chained.quantized[name].dequantize(), int4.quantized[name].dequantize())
    # the export's weights are the quantized base, and the resolved recipe travels with it
    w = base.get_submodule("model.layers.0.mlp.up_proj").weight
    err = (int8.quantized["model.layers.0.mlp.up_proj"].dequantize() - w).abs().max()
    assert 0 < err <= w.abs().max() / 127
    saved = yaml.safe_load((tmp_path / "out" / "int8" / "recipe.yaml").read_text())
    assert saved["stages"][0]["steps"][0]["bits"] == 8


def test_group_size_not_dividing_names_step_and_layer(tmp_path, tiny_llama_dir):
    stages = [{"name": "bad", "steps": [{"method": "rtn", "bits": 4, "group_size": 96}]}]
    recipe = load_recipe(recipe_file(tmp_path, tiny_llama_dir, stages))
    with pytest.raises(StepError) as err:
        compress_stages(recipe, tmp_path / "out", progress=False, log=lambda *_: None)
    msg = str(err.value)
    assert "stage 'bad' step 1 (rtn)" in msg and "in_features 128" in msg and "group_size 96" in msg
    assert not (tmp_path / "out" / "bad").exists()


def test_target_matching_nothing_is_a_config_error(tmp_path, tiny_llama_dir):
    from compress.config import ConfigError

    stages = [{"name": "x", "steps": [{"method": "rtn", "bits": 8, "targets": ["*qproj"]}]}]
    recipe = load_recipe(recipe_file(tmp_path, tiny_llama_dir, stages))
    with pytest.raises(ConfigError, match=r"step 1 \(rtn\).targets: pattern '\*qproj' matches no linear"):
        compress_stages(recipe, tmp_path / "out", progress=False, log=lambda *_: None)


def test_export_keeps_the_sources_tokenizer_files(tmp_path, tiny_llama_dir):
    """A checkpoint shipping ``tokenizer.model`` (sentencepiece) and a chat template next to
    ``tokenizer.json`` keeps both in every stage's export."""
    import shutil

    src = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, src)
    (src / "tokenizer.model").write_bytes(b"\x0a\x05sentencepiece-proto" * 16)
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    recipe = load_recipe(recipe_file(tmp_path, src, [{"name": "int8", "steps": [{"method": "rtn", "bits": 8}]}]))
    compress_stages(recipe, tmp_path / "out", progress=False, log=lambda *_: None)
    out = tmp_path / "out" / "int8"
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name


@pytest.mark.slow
def test_run_on_a_short_context_model_writes_its_report(tmp_path, capfd, monkeypatch):
    """A 128-token model through `compress run` with the evaluation defaults: every cell
    measured, the report written, and nothing on stderr but progress bars."""
    import json

    from compress.cli import main
    from tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "short", "llama", max_position_embeddings=128)
    recipe = recipe_file(tmp_path, model_dir, [{"name": "int8", "steps": [{"method": "rtn", "bits": 8}]}],
                         eval={"perplexity": {"max_tokens": 3000}, "tasks": ["pydoc_cloze"], "task_limit": 8})
    monkeypatch.chdir(tmp_path)                       # not a git repository
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert main(["run", str(recipe), "--threads", "1"]) == 0
    out, err = capfd.readouterr()
    stages = json.loads((tmp_path / "out" / "report.json").read_text())["stages"]
    assert [s["name"] for s in stages] == ["base", "int8"]
    for s in stages:
        assert "errors" not in s and s["context"] == 128
        assert s["perplexity"] > 1 and s["decode_tok_s"] > 0 and "acc" in s["tasks"]["pydoc_cloze"]
        assert s["speed"]["prompt_len"] + s["speed"]["new_tokens"] <= 128
    assert "perplexity windows of 128 tokens, stride 64" in (tmp_path / "out" / "report.md").read_text()
    assert "| `int8` |" in out
    noise = [line for line in err.splitlines() if line.strip() and not line.rstrip().endswith("/s]")]
    assert not noise, noise


def test_two_stages_from_base_both_quantize_a_tied_head(tmp_path):
    """A stage that quantizes the lm_head of a tied model must leave the next stage the tied
    model as it was (Llama-3.2, Qwen2.5, Qwen3 and SmolLM2 tie their embeddings)."""
    from tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tied", "qwen2", tie_word_embeddings=True)
    heads = ["re:.*layers\\.\\d+\\..*", "lm_head"]
    stages = [{"name": "int4-head", "steps": [{"method": "rtn", "bits": 4, "group_size": 32, "targets": heads}]},
              {"name": "int8-head", "steps": [{"method": "rtn", "bits": 8, "targets": heads}]}]
    recipe = load_recipe(recipe_file(tmp_path, model_dir, stages))
    compress_stages(recipe, tmp_path / "out", progress=False, log=lambda *_: None)
    embed = AutoModelForCausalLM.from_pretrained(model_dir).get_input_embeddings().weight
    for name, scheme, step in (("int4-head", "w4a16", 16), ("int8-head", "w8a8", 127)):
        head = load_checkpoint(tmp_path / "out" / name).quantized["lm_head"]
        assert head.scheme == scheme
        err = (head.dequantize() - embed).abs().max()
        assert 0 < err <= embed.abs().max() / step * 1.01   # the embedding, quantized: not a stale copy


def test_an_fp8_source_is_refused_before_any_work(tmp_path, tiny_llama_dir):
    """An FP8 checkpoint's weights are not floats without their scales: the recipe is refused
    at preflight, naming quantization_config, and a float8 tensor never reads as a weight."""
    import json
    import shutil

    from compress.config import ConfigError
    from compress.model_source import ModelSource, SourceError
    from compress.preflight import preflight

    src = tmp_path / "fp8"
    shutil.copytree(tiny_llama_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg))
    recipe = load_recipe(recipe_file(tmp_path, src, [{"name": "q", "steps": [{"method": "rtn", "bits": 8}]}]))
    with pytest.raises(ConfigError, match="quant_method.*fp8|fp8.*quant_method"):
        preflight(recipe)
    with pytest.raises(SourceError, match="fp8"):
        compress_stages(recipe, tmp_path / "out", progress=False, log=lambda *_: None)

    from safetensors.torch import save_file
    plain = tmp_path / "f8"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}))
    save_file({"w.weight": torch.ones(4, 4).to(torch.float8_e4m3fn)}, str(plain / "model.safetensors"))
    with pytest.raises(SourceError, match="'w.weight'.*float8_e4m3fn"):
        ModelSource(plain).weight("w.weight")


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["equal_head", "other_head"])
def test_a_tied_source_that_stores_its_head(tmp_path, offset):
    """A tied source with lm_head.weight stored anyway: an equal head is not exported twice
    (the loaders tie it); one with other values is kept, and the export's config is untied."""
    import json

    from safetensors.torch import load_file, save_file
    from tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tied", "qwen2", tie_word_embeddings=True)
    weights = load_file(str(model_dir / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + offset
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    recipe = load_recipe(recipe_file(tmp_path, model_dir, [{"name": "q", "steps": [{"method": "rtn", "bits": 8}]}]))
    compress_stages(recipe, tmp_path / "out", progress=False, log=lambda *_: None)
    out = tmp_path / "out" / "q"
    ckpt = load_checkpoint(out)
    assert ("lm_head.weight" in ckpt.dense) == (offset != 0.0)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] == (offset == 0.0)
