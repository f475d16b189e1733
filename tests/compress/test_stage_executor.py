"""The block-by-block stage executor: the same result as running each step over the
whole model in memory, sharded and bf16 inputs and outputs, tied heads, bad inputs."""
import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from compress.architectures import get_arch
from compress.calibration import load_calibration_ids
from compress.io.checkpoint import load_checkpoint
from compress.pipeline import compress_stages
from compress.recipe import load_recipe
from compress.state import CompressionState, StepContext
from quantizers.awq import AWQConfig, apply_awq
from quantizers.llm_int8 import LLMInt8Config, apply_llm_int8
from quantizers.rtn import RTNConfig, quantize_weight_rtn
from tiny_models import make_tiny_model

CALIB = "Return the sum of the values in the list. Sort the items by key. " * 100
QUIET = dict(progress=False, log=lambda *_: None)


def recipe_at(tmp_path: Path, model_dir: Path, stages, samples: int = 6, **extra):
    (tmp_path / "calib.txt").write_text(CALIB)
    doc = {"name": "t", "model": {"path": str(model_dir)},
           "calibration": {"files": ["calib.txt"], "samples": samples, "seq_len": 32},
           "stages": stages, "export": {"output": "out", **extra.pop("export", {})}, **extra}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(doc))
    return load_recipe(tmp_path / "recipe.yaml")


def test_two_calibrated_steps_equal_the_whole_model_run(tmp_path):
    """AWQ then LLM.int8 in one stage, streamed block by block (each step with its own
    calibration stream), give exactly what running each over the whole model gives."""
    model_dir = make_tiny_model(tmp_path / "m", "qwen2")
    steps = [{"method": "awq", "group_size": 64, "targets": ["*mlp*"]},
             {"method": "llm_int8", "threshold": 1.0, "targets": ["*self_attn*"], "batch_size": 4}]
    recipe = recipe_at(tmp_path, model_dir, [{"name": "mix", "steps": steps}])
    compress_stages(recipe, tmp_path / "out", **QUIET)
    streamed = load_checkpoint(tmp_path / "out" / "mix")

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = load_calibration_ids([str(tmp_path / "calib.txt")], tok, 6, 32, 0)
    state = CompressionState(model, get_arch("qwen2"), tok, str(model_dir))
    ctx = StepContext("t", lambda: ids, progress=False)
    apply_awq(state, AWQConfig(group_size=64, targets=["*mlp*"]), ctx)
    apply_llm_int8(state, LLMInt8Config(threshold=1.0, targets=["*self_attn*"], batch_size=4), ctx)

    assert set(state.quantized) == set(streamed.quantized) and len(state.quantized) == 14
    for name, qw in state.quantized.items():
        for key, t in qw.tensors.items():
            assert torch.equal(t, streamed.quantized[name].tensors[key]), (name, key)
    sd = model.state_dict()
    for name, t in streamed.dense.items():       # AWQ's scales folded into the norms, identically
        assert torch.equal(t, sd[name]), name
    assert any(not torch.equal(sd[n], t) for n, t in load_checkpoint(model_dir).dense.items() if "norm" in n)


def test_sharded_bf16_checkpoint_in_sharded_bf16_export_out(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "llama", dtype=torch.bfloat16, max_shard_size="100KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    recipe = recipe_at(tmp_path, model_dir, [{"name": "int4", "steps": [{"method": "rtn", "group_size": 32}]}],
                       export={"max_shard_size": "40KB"})
    compress_stages(recipe, tmp_path / "out", **QUIET)
    out = tmp_path / "out" / "int4"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted({f for f in index["weight_map"].values()})
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    manifest = json.loads((out / "compress_manifest.json").read_text())
    assert set(shards) <= set(manifest["files"]) and manifest["dense_dtype"] == "bfloat16"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    ck = load_checkpoint(out)
    assert all(t.dtype == torch.bfloat16 for t in ck.dense.values() if t.is_floating_point())
    src = AutoModelForCausalLM.from_pretrained(model_dir)
    w = src.get_submodule("model.layers.1.mlp.down_proj").weight.data
    want = quantize_weight_rtn(w.float(), RTNConfig(bits=4, group_size=32), "x")
    got = ck.quantized["model.layers.1.mlp.down_proj"]
    assert all(torch.equal(want.tensors[k], got.tensors[k]) for k in want.tensors)
    loaded = AutoModelForCausalLM.from_pretrained(out)            # transformers reads the sharded export
    assert loaded.config.num_hidden_layers == 2


def test_float32_working_dtype_on_a_bf16_checkpoint_exports_float32(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "llama", dtype=torch.bfloat16)
    recipe = recipe_at(tmp_path, model_dir, [{"name": "int8", "steps": [{"method": "rtn", "bits": 8}]}],
                       model={"path": str(model_dir), "dtype": "float32"})
    compress_stages(recipe, tmp_path / "out", **QUIET)
    ck = load_checkpoint(tmp_path / "out" / "int8")
    assert ck.dense["model.norm.weight"].dtype == torch.float32


def test_tied_head_quantized_keeps_the_embedding_float(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "llama", tie_word_embeddings=True)
    stages = [{"name": "head", "steps": [{"method": "rtn", "bits": 8, "targets": ["lm_head"]}]},
              {"name": "plain", "steps": [{"method": "rtn", "bits": 8}]}]
    recipe = recipe_at(tmp_path, model_dir, stages)
    compress_stages(recipe, tmp_path / "out", **QUIET)
    src = load_checkpoint(model_dir)
    head = load_checkpoint(tmp_path / "out" / "head")
    assert set(head.quantized) == {"lm_head"} and not head.config.tie_word_embeddings
    assert torch.equal(head.dense["model.embed_tokens.weight"], src.dense["model.embed_tokens.weight"])
    err = (head.quantized["lm_head"].dequantize() - src.dense["model.embed_tokens.weight"]).abs().max()
    assert 0 < err < 0.01
    plain = load_checkpoint(tmp_path / "out" / "plain")
    assert plain.config.tie_word_embeddings and "lm_head.weight" not in plain.dense


def test_missing_input_shard_is_named(tmp_path):
    from compress.model_source import SourceError

    model_dir = make_tiny_model(tmp_path / "m", "llama", max_shard_size="100KB")
    shard = sorted(model_dir.glob("model-*.safetensors"))[-1]
    shard.unlink()
    recipe = recipe_at(tmp_path, model_dir, [{"name": "int8", "steps": [{"method": "rtn", "bits": 8}]}])
    with pytest.raises(SourceError, match=f"lists shard {shard.name}, which is missing"):
        compress_stages(recipe, tmp_path / "out", **QUIET)
    assert not (tmp_path / "out" / "int8").exists()


def test_a_model_too_big_for_the_machine_fails_before_any_work(tmp_path, monkeypatch):
    from compress import memory_estimate

    model_dir = make_tiny_model(tmp_path / "m", "llama")
    monkeypatch.setattr(memory_estimate, "available_bytes", lambda: 100_000_000)
    recipe = recipe_at(tmp_path, model_dir, [{"name": "a", "steps": [{"method": "awq", "group_size": 64}]}])
    with pytest.raises(memory_estimate.MemoryEstimateError, match=r"needs about 0\.\d GB .*0\.1 GB available"):
        compress_stages(recipe, tmp_path / "out", **QUIET)
    assert not (tmp_path / "out").exists()


def test_transforms_run_first_with_their_teacher_then_block_steps(tmp_path, monkeypatch):
    """A transform step (a whole-model rewrite, as prune and distill are) gets its
    teacher's directory (the stage's source unless the step names one); its output is
    what the stage's next step reads, through a temporary export that is removed."""
    from dataclasses import dataclass

    from compress import registry
    from compress.stage_executor import ModelTransform

    seen = []

    @dataclass
    class DoubleNormConfig:
        pass

    class DoubleNorm(ModelTransform):
        def __init__(self, model, arch, config, ctx):
            seen.append(ctx.teacher)

        def run(self, source, skeleton, arch, calibration, writer):
            for name in source.names():
                t = source.weight(name)
                writer.add_dense(name, t * 2 if name == "model.norm.weight" else t)
            return skeleton.config

    def never(*_):
        raise AssertionError("whole-model path not used by compress_stages")

    monkeypatch.setitem(registry.METHODS, "double_norm", registry.Method(
        "double_norm", DoubleNormConfig, never, DoubleNorm, False, "doubles the final norm", kind="transform",
        uses_teacher=True))
    model_dir = make_tiny_model(tmp_path / "m", "llama")
    stages = [{"name": "a", "steps": [{"method": "double_norm"}]},
              {"name": "b", "from": "a", "steps": [{"method": "double_norm"}, {"method": "double_norm", "teacher": "base"},
                                                   {"method": "rtn", "bits": 8}]}]
    recipe = recipe_at(tmp_path, model_dir, stages)
    compress_stages(recipe, tmp_path / "out", **QUIET)
    assert seen == [str(model_dir), str(tmp_path / "out" / "a"), str(model_dir)]
    base = load_checkpoint(model_dir)
    torch.testing.assert_close(load_checkpoint(tmp_path / "out" / "a").dense["model.norm.weight"],
                               2 * base.dense["model.norm.weight"])
    b = load_checkpoint(tmp_path / "out" / "b")
    torch.testing.assert_close(b.dense["model.norm.weight"], 8 * base.dense["model.norm.weight"])
    assert len(b.quantized) == 14
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a", "b"]     # no temporary left


def test_a_stage_from_a_pruned_stage_reads_the_smaller_shapes(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "llama")
    stages = [{"name": "pruned", "steps": [{"method": "prune", "targets": {"intermediate_size": 128}}]},
              {"name": "int4", "from": "pruned", "steps": [{"method": "rtn", "group_size": 32}]}]
    recipe = recipe_at(tmp_path, model_dir, stages)
    compress_stages(recipe, tmp_path / "out", **QUIET)
    ck = load_checkpoint(tmp_path / "out" / "int4")
    assert ck.config.intermediate_size == 128 and len(ck.quantized) == 14
    assert ck.quantized["model.layers.0.mlp.down_proj"].meta["in_features"] == 128
