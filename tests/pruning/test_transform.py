"""``method: prune`` through real recipes (compress_stages): the pruned export loads in
transformers and our runtime gives its logits; importance removes exactly what does not
contribute, and beats random indices where channels differ; random is seeded; depth
pruning drops the block that passes its input on; prune + rtn in one stage; bad input."""
import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from compress.config import ConfigError
from compress.errors import StepError
from compress.io.checkpoint import load_checkpoint
from compress.pipeline import compress_stages
from compress.recipe import load_recipe
from compress.runtime import LLM
from tiny_models import make_tiny_model

CALIB = "Return the sum of the values in the list. Sort the items by key. " * 100
QUIET = dict(progress=False, log=lambda *_: None)
IDS = torch.randint(2, 512, (3, 24), generator=torch.Generator().manual_seed(7))
ALL_FIVE = dict(hidden_size=96, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                num_hidden_layers=2)


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Many tiny ops (see tests/conftest.py::one_thread)."""


def write_recipe(tmp_path: Path, model_dir: Path, stages, samples: int = 8) -> Path:
    (tmp_path / "calib.txt").write_text(CALIB)
    doc = {"name": "t", "model": {"path": str(model_dir)},
           "calibration": {"files": ["calib.txt"], "samples": samples, "seq_len": 32},
           "stages": stages, "export": {"output": "out"}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(doc))
    return tmp_path / "recipe.yaml"


def run(tmp_path: Path, model_dir: Path, stages, **kw) -> dict:
    recipe = load_recipe(write_recipe(tmp_path, model_dir, stages, **kw))
    _, results = compress_stages(recipe, tmp_path / "out", **QUIET)
    return {r.name: r for r in results}


def prune(name: str, targets: dict, **kw) -> dict:
    return {"name": name, "steps": [{"method": "prune", "targets": targets, **kw}]}


def load(path: Path):
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def edit(model_dir: Path, change) -> AutoModelForCausalLM:
    """Rewrite ``model_dir``'s weights with ``change(model)``; returns the changed model."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        change(model)
    model.save_pretrained(model_dir)
    return model


@pytest.mark.parametrize("family, tied", [("llama", False), ("llama", True), ("mistral", False), ("qwen2", False),
                                          ("qwen3", True)])
def test_pruned_export_loads_in_transformers_and_our_runtime_gives_its_logits(family, tied, tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", family, num_hidden_layers=3, tie_word_embeddings=tied)
    stats = run(tmp_path, model_dir, [prune("p", ALL_FIVE)])["p"].stats["prune"]
    small = load(tmp_path / "out" / "p")
    c = small.config
    head_dim = 64 if family == "qwen3" else 32    # kept: qwen3's tiny config has its own
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
            c.num_hidden_layers, c.head_dim) == (96, 128, 2, 1, 2, head_dim)
    assert c.tie_word_embeddings == tied
    assert stats["parameters_after"] == sum(p.numel() for p in small.parameters())
    assert stats["parameters_before"] == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    got = LLM(tmp_path / "out" / "p").logits(IDS)
    torch.testing.assert_close(got, logits(small), atol=2e-4, rtol=1e-4)


def silence(model, silent_mlp, silent_kv_group, head_dim=32):
    """Zero the up_proj rows of ``silent_mlp[b]`` (their down_proj inputs become 0) and the
    v rows of kv group ``silent_kv_group[b]`` (its query heads' outputs become 0)."""
    for b, layer in enumerate(model.model.layers):
        layer.mlp.up_proj.weight[silent_mlp[b]] = 0
        rows = slice(silent_kv_group[b] * head_dim, (silent_kv_group[b] + 1) * head_dim)
        layer.self_attn.v_proj.weight[rows] = 0
        if layer.self_attn.v_proj.bias is not None:
            layer.self_attn.v_proj.bias[rows] = 0


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_importance_removes_exactly_the_silent_channels_and_kv_group(family, tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", family)
    silent = [torch.randperm(256, generator=torch.Generator().manual_seed(b))[:128].sort().values for b in range(2)]
    original = edit(model_dir, lambda m: silence(m, silent, [1, 0]))
    run(tmp_path, model_dir, [prune("p", {"intermediate_size": 128, "num_key_value_heads": 1})])
    small = load(tmp_path / "out" / "p")
    for b in range(2):
        live = torch.ones(256, dtype=torch.bool)
        live[silent[b]] = False
        big, cut = original.model.layers[b], small.model.layers[b]
        assert torch.equal(cut.mlp.up_proj.weight, big.mlp.up_proj.weight[live])
        assert torch.equal(cut.mlp.down_proj.weight, big.mlp.down_proj.weight[:, live])
        kept = slice(0, 32) if b == 0 else slice(32, 64)            # the other kv group
        assert torch.equal(cut.self_attn.k_proj.weight, big.self_attn.k_proj.weight[kept])
    assert (small.config.num_attention_heads, small.config.num_key_value_heads) == (2, 1)
    torch.testing.assert_close(logits(small), logits(original), rtol=0, atol=1e-5)


def kl_to(reference, model) -> float:
    p, q = logits(reference).log_softmax(-1), logits(model).log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_importance_beats_random_indices_where_channels_differ(tmp_path):
    """MLP channels scaled by log-normal factors (as trained models' are uneven): the
    importance cut stays far closer to the model than any of three random cuts."""
    model_dir = make_tiny_model(tmp_path / "m", "llama")
    gen = torch.Generator().manual_seed(0)

    def uneven(model):
        for layer in model.model.layers:
            layer.mlp.up_proj.weight.mul_(torch.randn(256, 1, generator=gen).mul(1.5).exp())

    original = edit(model_dir, uneven)
    target = {"intermediate_size": 96}
    stages = [prune("imp", target)] + [prune(f"rand{s}", target, strategy="random", seed=s) for s in range(3)]
    run(tmp_path, model_dir, stages)
    kl = {name: kl_to(original, load(tmp_path / "out" / name)) for name in ("imp", "rand0", "rand1", "rand2")}
    assert kl["imp"] < 0.5 * min(kl[f"rand{s}"] for s in range(3)), kl


def test_random_strategy_is_seeded_and_has_the_importance_shapes(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "qwen2", num_hidden_layers=3)
    stages = [prune("a", ALL_FIVE, strategy="random", seed=5), prune("b", ALL_FIVE, strategy="random", seed=5),
              prune("c", ALL_FIVE, strategy="random", seed=6), prune("imp", ALL_FIVE)]
    results = run(tmp_path, model_dir, stages)
    a, b, c, imp = (load_checkpoint(tmp_path / "out" / n).dense for n in ("a", "b", "c", "imp"))
    assert a.keys() == b.keys() == c.keys() == imp.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sum(not torch.equal(a[k], c[k]) for k in a) > len(a) // 2
    assert all(a[k].shape == imp[k].shape for k in a)
    assert results["a"].stats["prune"]["kept_blocks"] == results["b"].stats["prune"]["kept_blocks"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_block_importance_drops_the_block_that_passes_its_input_on(family, tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", family, num_hidden_layers=3)

    def identity_block(model):
        layer = model.model.layers[1]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()

    original = edit(model_dir, identity_block)
    stats = run(tmp_path, model_dir, [prune("d", {"num_hidden_layers": 2})])["d"].stats["prune"]
    bi = stats["block_importance"]
    assert bi[1] < 1e-6 and min(bi[0], bi[2]) > 1e-3, bi
    assert stats["kept_blocks"] == [0, 2]
    small = load(tmp_path / "out" / "d")
    assert torch.equal(small.model.layers[1].mlp.up_proj.weight, original.model.layers[2].mlp.up_proj.weight)
    torch.testing.assert_close(logits(small), logits(original), rtol=0, atol=1e-5)
    config = json.loads((tmp_path / "out" / "d" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and len(config.get("layer_types") or [0, 0]) == 2


def test_lm_loss_depth_metric_keeps_the_blocks_whose_loss_matters(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "llama", num_hidden_layers=3)
    stats = run(tmp_path, model_dir, [prune("d", {"num_hidden_layers": 1}, depth_metric="lm_loss")])["d"].stats
    increase = stats["prune"]["lm_loss_increase"]
    assert len(increase) == 3 and "block_importance" not in stats["prune"]
    assert stats["prune"]["kept_blocks"] == [max(range(3), key=increase.__getitem__)]
    assert load(tmp_path / "out" / "d").config.num_hidden_layers == 1


def test_prune_then_rtn_in_one_stage(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "llama", num_hidden_layers=3)
    targets = {"intermediate_size": 128, "num_hidden_layers": 2}
    stages = [prune("p", targets),
              {"name": "q", "steps": [{"method": "prune", "targets": targets}, {"method": "rtn", "bits": 8}]}]
    run(tmp_path, model_dir, stages)
    ck = load_checkpoint(tmp_path / "out" / "q")
    assert len(ck.quantized) == 14 and ck.config.num_hidden_layers == 2
    assert list(ck.quantized["model.layers.1.mlp.up_proj"].dequantize().shape) == [128, 128]
    float_logits = LLM(tmp_path / "out" / "p").logits(IDS)
    int8_logits = LLM(tmp_path / "out" / "q").logits(IDS)
    assert 0 < (int8_logits - float_logits).abs().max() < 0.05
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["p", "q"]     # no temporary left


@pytest.mark.parametrize("targets, key, message", [
    ({"num_attention_heads": 3}, "num_attention_heads", "3 query heads cannot be shared evenly by the 2 key/value"),
    ({"num_attention_heads": 4, "num_key_value_heads": 1}, "num_attention_heads", "would be 4 per kv head"),
    ({"intermediate_size": 512}, "intermediate_size", "512 exceeds the model's intermediate_size of 256"),
    ({"hidden_size": 129}, "hidden_size", "129 exceeds the model's hidden_size of 128"),
    ({"num_hidden_layers": 3}, "num_hidden_layers", "3 exceeds the model's num_hidden_layers of 2"),
])
def test_targets_the_model_cannot_take_are_named_before_any_work(targets, key, message, tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "llama")
    with pytest.raises(ConfigError, match=message) as err:
        run(tmp_path, model_dir, [prune("p", targets)])
    assert err.value.where == f"{tmp_path / 'recipe.yaml'}: stage 'p' step 1 (prune).targets.{key}"
    assert not (tmp_path / "out" / "p").exists()


def test_dry_run_checks_the_bounds(tmp_path):
    from compress.preflight import preflight

    model_dir = make_tiny_model(tmp_path / "m", "llama")
    recipe = load_recipe(write_recipe(tmp_path, model_dir, [prune("p", {"intermediate_size": 512})]))
    with pytest.raises(ConfigError, match="exceeds the model's intermediate_size") as err:
        preflight(recipe)
    assert err.value.where.endswith("stage 'p' step 1 (prune).targets.intermediate_size")


def test_a_hidden_size_the_head_layout_cannot_take(tmp_path, monkeypatch):
    """A config class that derives head_dim from hidden_size / num_attention_heads (as
    some model types do) cannot describe a hidden cut that keeps head_dim; the llama
    family's configs carry head_dim, so this one is made to derive it."""
    from transformers import LlamaConfig

    model_dir = make_tiny_model(tmp_path / "m", "llama")
    post_init = LlamaConfig.__post_init__

    def derived_head_dim(self, **kwargs):
        post_init(self, **kwargs)
        self.head_dim = self.hidden_size // self.num_attention_heads

    monkeypatch.setattr(LlamaConfig, "__post_init__", derived_head_dim)
    with pytest.raises(ConfigError, match="96 does not fit the head layout: LlamaConfig makes head_dim 24") as err:
        run(tmp_path, model_dir, [prune("p", {"hidden_size": 96})])
    assert err.value.where.endswith("(prune).targets.hidden_size")


def test_hidden_size_is_checked_against_the_pruned_head_count(tmp_path):
    """LlamaConfig (transformers 5) wants hidden_size % num_attention_heads == 0: of the
    pruned config's heads, not the source's. 126 with 2 heads is a shape it builds (126 %
    4 heads is not 0: once wrongly refused); 125 with 2 is a ConfigError naming the key."""
    model_dir = make_tiny_model(tmp_path / "m", "llama")
    (tmp_path / "ok").mkdir()
    (tmp_path / "bad").mkdir()
    done = run(tmp_path / "ok", model_dir, [prune("p", {"hidden_size": 126, "num_attention_heads": 2})])
    cfg = load(done["p"].path).config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim) == (126, 2, 32)
    with pytest.raises(ConfigError, match="125 with 2 query heads: LlamaConfig refuses") as err:
        run(tmp_path / "bad", model_dir, [prune("p", {"hidden_size": 125, "num_attention_heads": 2})])
    assert err.value.where.endswith("(prune).targets.hidden_size")


def test_heads_of_a_model_without_gqa_name_the_kv_heads(tmp_path):
    """One kv head per query head (Llama-2, no GQA): fewer query heads need as many fewer
    kv heads, and the error says so rather than asking for a multiple of the kv heads."""
    model_dir = make_tiny_model(tmp_path / "m", "llama", num_key_value_heads=4)
    with pytest.raises(ConfigError, match="set num_key_value_heads: 2 too"):
        run(tmp_path, model_dir, [prune("p", {"num_attention_heads": 2})])


@pytest.mark.parametrize("step, key, message", [
    ({"targets": {"num_hidden_layers": 0}}, "targets.num_hidden_layers", "must be at least 1, got 0"),
    ({"targets": {"num_attention_heads": 3, "num_key_value_heads": 2}}, "targets.num_attention_heads",
     "give a multiple of 2"),
    ({"targets": {"layers": 1}}, "targets.layers", "unknown key 'layers'"),
    ({}, "targets", "give at least one size to prune to"),
    ({"targets": {"hidden_size": 64}, "strategy": "magnitude"}, "strategy", "must be one of"),
])
def test_bad_steps_are_refused_by_the_recipe(step, key, message, tmp_path):
    path = write_recipe(tmp_path, tmp_path, [{"name": "p", "steps": [{"method": "prune", **step}]}])
    with pytest.raises(ConfigError, match=message) as err:
        load_recipe(path)
    assert err.value.where == f"{path}: stage 'p' step 1 (prune).{key}"


@pytest.mark.parametrize("stages", [
    [{"name": "a", "steps": [{"method": "rtn", "bits": 8}, {"method": "prune", "targets": {"hidden_size": 64}}]}],
    [{"name": "a", "steps": [{"method": "rtn", "bits": 8}]},
     {"name": "b", "from": "a", "steps": [{"method": "prune", "targets": {"hidden_size": 64}}]}],
])
def test_prune_after_a_quantizing_step_is_refused(stages, tmp_path):
    with pytest.raises(ConfigError, match=r"prune transforms the float model, but stage 'a' step 1 \(rtn\) has quantized"):
        load_recipe(write_recipe(tmp_path, tmp_path, stages))


def test_a_quantized_model_is_refused(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "llama")
    run(tmp_path, model_dir, [{"name": "int8", "steps": [{"method": "rtn", "bits": 8}]}])
    (tmp_path / "again").mkdir()
    with pytest.raises(StepError, match="holds quantized layers .*prune works on a float model"):
        run(tmp_path / "again", tmp_path / "out" / "int8", [prune("p", {"intermediate_size": 128})])
    assert not (tmp_path / "again" / "out" / "p").exists()


@pytest.mark.slow
def test_peak_rss_of_importance_and_cut_stays_far_under_the_model(tmp_path):
    from stage_rss import run_measuring_rss

    # ~160M parameters stored as float32 (0.64 GB): a whole-model copy would add as much
    model_dir = make_tiny_model(tmp_path / "m", "llama", hidden_size=1024, intermediate_size=2816,
                                num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                                vocab_size=32000, max_shard_size="300MB")
    stored = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    targets = {"intermediate_size": 1408, "num_attention_heads": 8, "hidden_size": 768, "num_hidden_layers": 6}
    recipe = write_recipe(tmp_path, model_dir, [prune("p", targets)], samples=4)
    rss = run_measuring_rss(recipe)
    growth = rss["peak"] - rss["baseline"]
    print(f"stored {stored / 1e6:.0f} MB, baseline RSS {rss['baseline'] / 1e6:.0f} MB, "
          f"peak {rss['peak'] / 1e6:.0f} MB, growth {growth / 1e6:.0f} MB")
    # transformers' own set-up (~0.15 GB), one float32 block, the largest tensor (the
    # 131 MB embedding) with its cut copy: no whole-model copy (that alone would add 1.0 x stored)
    assert growth <= 0.7 * stored
    assert load(tmp_path / "out" / "p").config.intermediate_size == 1408
