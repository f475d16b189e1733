"""`compress bench make-model`: a random-init Llama of the asked shape as a plain HF
directory plus RTN int4 / int8 exports that the runtime loads, with the lm_head in int8
unless asked otherwise."""
import json

import pytest
import torch

from compress.cli import main
from compress.io.inspect import inspect_checkpoint


def test_make_model_writes_the_asked_shape_and_exports(tiny_bench_model):
    cfg = json.loads((tiny_bench_model["hf"] / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (128, 2, 256, 4, 2, 512)
    schemes = {name: {layer: spec["scheme"] for layer, spec in inspect_checkpoint(str(tiny_bench_model[name]))
                      ["layers"].items()} for name in ("rtn-int4", "rtn-int8")}
    assert schemes["rtn-int4"]["lm_head"] == "w8a8" and schemes["rtn-int8"]["lm_head"] == "w8a8"
    assert {s for layer, s in schemes["rtn-int4"].items() if layer != "lm_head"} == {"w4a16"}
    assert {s for layer, s in schemes["rtn-int8"].items() if layer != "lm_head"} == {"w8a8"}
    assert len(schemes["rtn-int4"]) == 2 * 7 + 1  # 7 linears in each of 2 layers, and the head


def test_make_model_exports_follow_the_dense_model(tiny_bench_model):
    """The int8 export's logits stay close to the dense model's (it is the same model)."""
    from transformers import AutoModelForCausalLM

    from compress.runtime import LLM

    ids = torch.arange(5, 37).unsqueeze(0)
    dense = AutoModelForCausalLM.from_pretrained(tiny_bench_model["hf"]).eval()
    with torch.no_grad():
        want = dense(ids).logits.float()
    got = LLM(tiny_bench_model["rtn-int8"], kernels="reference").logits(ids)
    assert ((got - want).norm() / want.norm()) < 0.05


def test_make_model_cli_dense_head_and_tokenizer(tmp_path, repo_root, tiny_bench_shape):
    out = tmp_path / "m"
    shape = [f"--{k.replace('_', '-')}={v}" for k, v in tiny_bench_shape.items()]
    assert main(["bench", "make-model", "--out", str(out), *shape, "--lm-head", "dense", "--no-sentencepiece",
                 "--tokenizer-from", str(repo_root / "models" / "pydoc-llama")]) == 0
    assert (out / "hf" / "tokenizer.json").is_file() and (out / "rtn-int4" / "tokenizer.json").is_file()
    assert "lm_head" not in inspect_checkpoint(str(out / "rtn-int4"))["layers"]
    # a rerun replaces its own output
    assert main(["bench", "make-model", "--out", str(out), *shape, "--no-sentencepiece",
                 "--tokenizer-from", "none"]) == 0
    assert not (out / "hf" / "tokenizer.json").exists()


def test_make_model_refuses_a_directory_it_did_not_write(tmp_path, capsys):
    (tmp_path / "m" / "hf").mkdir(parents=True)
    (tmp_path / "m" / "hf" / "notes.txt").write_text("mine")
    assert main(["bench", "make-model", "--out", str(tmp_path / "m"), "--hidden", "128", "--layers", "1",
                 "--intermediate", "256", "--vocab", "64", "--no-sentencepiece", "--tokenizer-from", "none"]) == 2
    assert "refusing to replace" in capsys.readouterr().err
    assert (tmp_path / "m" / "hf" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("flag,value", [("--tokenizer-from", "/nonexistent/dir")])
def test_make_model_names_a_bad_option(tmp_path, capsys, flag, value):
    assert main(["bench", "make-model", "--out", str(tmp_path / "m"), flag, value]) == 2
    assert flag in capsys.readouterr().err


# ---------------------------------------------------------------- sharded, bf16, streamed
def _tensors(hf):
    from compress.io.safetensors_files import TensorStore

    store = TensorStore(hf)
    return {name: store.read(name) for name in store.names()}


def _make(out, shape, **kw):
    from compress.bench.make_model import make_bench_model

    return make_bench_model(out, **shape, tokenizer_from=None, sentencepiece=False, log=lambda *_: None, **kw)


def test_bf16_shards_are_named_indexed_and_load_in_transformers(tmp_path, tiny_bench_shape):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    paths = _make(tmp_path / "m", tiny_bench_shape, dtype="bfloat16", max_shard_size="200KB", exports="none")
    hf = paths["hf"]
    assert set(paths) == {"hf"} and sorted(p.name for p in (tmp_path / "m").iterdir()) == ["hf"]
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in hf.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (hf / "model.safetensors").exists()
    assert json.loads((hf / "config.json").read_text())["dtype"] == "bfloat16"
    assert (hf / "generation_config.json").is_file()
    sizes = 0
    for shard in shards:
        with safe_open(str(hf / shard), framework="pt") as st:
            names = list(st.keys())
            assert all(index["weight_map"][k] == shard for k in names)
            shard_bytes = sum(st.get_tensor(k).nbytes for k in names)
        assert shard_bytes <= 200_000 or len(names) == 1, shard
        sizes += shard_bytes
    assert index["metadata"]["total_size"] == sizes

    model = AutoModelForCausalLM.from_pretrained(hf)
    stored = _tensors(hf)
    got = model.state_dict()
    assert set(got) == set(stored) == set(index["weight_map"])
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert all(torch.equal(got[k], stored[k]) for k in stored)
    assert torch.equal(stored["model.norm.weight"], torch.ones(tiny_bench_shape["hidden"], dtype=torch.bfloat16))
    w = stored["model.layers.1.mlp.down_proj.weight"].float()
    assert abs(w.mean()) < 2e-3 and abs(w.std() - 0.02) < 1e-3
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(3, 11).unsqueeze(0)).logits).all()


def test_weights_follow_the_seed_not_the_dtype_or_sharding(tmp_path, tiny_bench_shape):
    a = _tensors(_make(tmp_path / "a", tiny_bench_shape, dtype="bfloat16", max_shard_size="100KB",
                       exports="none")["hf"])
    b = _tensors(_make(tmp_path / "b", tiny_bench_shape, dtype="float32", exports="none")["hf"])
    c = _tensors(_make(tmp_path / "c", tiny_bench_shape, dtype="bfloat16", exports="none", seed=1)["hf"])
    again = _tensors(_make(tmp_path / "d", tiny_bench_shape, dtype="bfloat16", max_shard_size="100KB",
                           exports="none")["hf"])
    assert (tmp_path / "b" / "hf" / "model.safetensors").is_file(), "one shard: HF's single-file name"
    assert all(torch.equal(a[k], again[k]) for k in a)
    assert all(torch.equal(a[k], b[k].to(torch.bfloat16)) for k in a), "bf16 is the float32 model rounded"
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])


def test_exports_read_back_a_bf16_model(tmp_path, tiny_bench_shape):
    """Only the asked export is written, from the stored bf16 weights: its logits stay
    close to the dense model's."""
    from transformers import AutoModelForCausalLM

    from compress.runtime import LLM

    paths = _make(tmp_path / "m", tiny_bench_shape, dtype="bfloat16", max_shard_size="300KB", exports="int8")
    assert set(paths) == {"hf", "rtn-int8"} and not (tmp_path / "m" / "rtn-int4").exists()
    layers = inspect_checkpoint(str(paths["rtn-int8"]))["layers"]
    assert {spec["scheme"] for spec in layers.values()} == {"w8a8"} and "lm_head" in layers
    ids = torch.arange(5, 37).unsqueeze(0)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(paths["hf"], dtype=torch.float32).eval()(ids).logits
    got = LLM(paths["rtn-int8"], kernels="reference").logits(ids)
    assert ((got - want).norm() / want.norm()) < 0.05


def test_make_model_cli_preset_with_overrides(tmp_path, tiny_bench_shape):
    """--preset sets the shape; the shape options given beside it override single values."""
    out = tmp_path / "m"
    shape = [f"--{k.replace('_', '-')}={v}" for k, v in tiny_bench_shape.items() if k != "max_positions"]
    assert main(["bench", "make-model", "--out", str(out), "--preset", "llama-2-7b", *shape, "--dtype", "float16",
                 "--exports", "none", "--no-sentencepiece", "--tokenizer-from", "none"]) == 0
    cfg = json.loads((out / "hf" / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["max_position_embeddings"], cfg["dtype"]) == (128, 4096, "float16")
    assert sorted(p.name for p in out.iterdir()) == ["hf"]


def test_the_7b_preset_has_llama_2_7b_tensors():
    """Llama-2-7B's shape, read on the meta device only (nothing is written)."""
    from compress.bench.make_model import bench_config, resolve_shape, tensor_specs

    shape = resolve_shape("llama-2-7b")
    assert shape == dict(hidden=4096, layers=32, intermediate=11008, heads=32, kv_heads=32, vocab=32000,
                         max_positions=4096)
    assert resolve_shape("llama-2-7b", layers=2, hidden=None)["layers"] == 2
    specs = tensor_specs(bench_config(shape, torch.bfloat16))
    assert sum(s.numel() for s in specs) == 6_738_415_616
    assert sum(s.quantized for s in specs) == 32 * 7


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30), ("1000", 1000), ("1.5mb", 1_500_000)])
def test_max_shard_size_units(text, size):
    from compress.bench.make_model import parse_size

    assert parse_size(text) == size


@pytest.mark.parametrize("flag,value", [("--max-shard-size", "lots"), ("--max-shard-size", "0")])
def test_make_model_names_a_bad_shard_size(tmp_path, capsys, flag, value):
    assert main(["bench", "make-model", "--out", str(tmp_path / "m"), flag, value]) == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
