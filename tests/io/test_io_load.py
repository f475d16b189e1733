"""Loading plain HF dirs and third-party compressed-tensors dirs; every bad input names what and where."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from compress.io.checkpoint import CheckpointError, load_checkpoint, resolve_model_path
from compress.io.export import export_checkpoint
from compress.io.inspect import format_inspect, inspect_checkpoint
from io_helpers import all_linears, assert_qw_equal, int4_rtn, split_model, w8a8_rtn


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tiny_llama):
    from transformers import LlamaForCausalLM
    cfg, sd = tiny_llama
    d = tmp_path_factory.mktemp("hf")
    m = LlamaForCausalLM(cfg)
    m.load_state_dict(sd)
    m.save_pretrained(str(d))
    return d


@pytest.fixture
def export_dir(tmp_path, tiny_llama):
    cfg, sd = tiny_llama
    dense, q = split_model(sd, {m: int4_rtn for m in all_linears()})
    return export_checkpoint(tmp_path / "ck", cfg, dense, q)


def test_plain_hf_dir(hf_dir, tiny_llama):
    _, sd = tiny_llama
    ck = load_checkpoint(hf_dir)
    assert ck.manifest is None and not ck.quantized
    assert ck.config.model_type == "llama"
    for k, v in sd.items():
        if k in ck.dense:
            assert torch.equal(ck.dense[k], v)
    d = inspect_checkpoint(hf_dir)
    assert d["format"] == "huggingface" and d["bits_per_weight"] == 32.0
    assert d["scheme_counts"] == {"dense": 14}


def test_sharded_plain_hf_dir(tmp_path, tiny_llama):
    from transformers import LlamaForCausalLM
    cfg, sd = tiny_llama
    m = LlamaForCausalLM(cfg)
    m.load_state_dict(sd)
    m.save_pretrained(str(tmp_path), max_shard_size="400KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ck = load_checkpoint(tmp_path)
    assert torch.equal(ck.dense["model.layers.1.mlp.down_proj.weight"], sd["model.layers.1.mlp.down_proj.weight"])


def test_third_party_compressed_tensors_dir(tmp_path, export_dir):
    """Drop our manifest: the pack-quantized dir still loads from tensor names + config."""
    third = tmp_path / "third"
    shutil.copytree(export_dir, third)
    (third / "compress_manifest.json").unlink()
    a, b = load_checkpoint(export_dir), load_checkpoint(third)
    assert b.manifest is None and set(a.quantized) == set(b.quantized)
    for m in a.quantized:
        assert_qw_equal(a.quantized[m], b.quantized[m])
        assert b.quantized[m].meta["group_size"] == 128


def test_loaded_checkpoint_reads_tensors_when_asked(export_dir, tiny_llama, monkeypatch):
    """The checkpoint holds headers, not weights: loading reads each tensor it checks one
    at a time and keeps none; names, membership and schemes need no read; every access
    reads a new tensor (nothing cached that a builder could not free)."""
    from compress.io import safetensors_files
    _, sd = tiny_llama
    ck = load_checkpoint(export_dir)
    reads = []
    real_read = safetensors_files.TensorStore.read
    monkeypatch.setattr(safetensors_files.TensorStore, "read",
                        lambda self, name: reads.append(name) or real_read(self, name))
    assert "model.embed_tokens.weight" in ck.dense and "model.layers.0.mlp.up_proj" in ck.quantized
    assert "model.layers.0.mlp.up_proj.weight" not in ck.dense and "nope" not in ck.quantized
    assert set(ck.schemes.values()) == {"w4a16"} and len(ck.quantized) == 14
    assert sorted(ck.dense) == sorted(k for k in sd if not any(k == m + ".weight" for m in all_linears()))
    assert reads == []
    a, b = ck.dense["model.norm.weight"], ck.dense["model.norm.weight"]
    assert torch.equal(a, sd["model.norm.weight"]) and a.data_ptr() != b.data_ptr()
    qw = ck.quantized["model.layers.1.self_attn.o_proj"]
    assert qw.scheme == "w4a16" and qw.tensors["qweight"].dtype == torch.int32
    assert reads[:2] == ["model.norm.weight"] * 2
    assert sorted(reads[2:]) == [f"model.layers.1.self_attn.o_proj.{t}" for t in
                                 ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")]
    with pytest.raises(KeyError):
        ck.dense["model.layers.0.mlp.up_proj.weight"]


def test_reading_from_a_replaced_file_is_refused(export_dir):
    """A checkpoint reads lazily: a weights file replaced after loading (even with the same
    bytes) is refused by name rather than mixed into what was already read."""
    ck = load_checkpoint(export_dir)
    f = export_dir / "model.safetensors"
    data = f.read_bytes()
    f.unlink()
    f.write_bytes(data)
    with pytest.raises(CheckpointError, match=r"model\.safetensors changed since the checkpoint was loaded"):
        ck.dense["model.norm.weight"]
    with pytest.raises(CheckpointError, match="changed since"):
        ck.quantized["model.layers.0.mlp.up_proj"]
    assert load_checkpoint(export_dir).dense["model.norm.weight"].shape == (256,)  # loaded again: reads


def test_sharded_export_names_a_missing_shard(tmp_path, tiny_llama):
    cfg, sd = tiny_llama
    dense, q = split_model(sd, {m: w8a8_rtn for m in all_linears()})
    out = export_checkpoint(tmp_path / "s", cfg, dense, q, max_shard_bytes=300_000)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    ck = load_checkpoint(out)
    assert all(torch.equal(ck.quantized[m].tensors["qweight"], q[m].tensors["qweight"]) for m in q)
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"lists shard {shards[1].name}, which is missing"):
        load_checkpoint(out, verify=False)


def test_index_naming_a_tensor_no_shard_holds(tmp_path, tiny_llama):
    cfg, sd = tiny_llama
    out = export_checkpoint(tmp_path / "s", cfg, sd, {}, max_shard_bytes=300_000)
    index = out / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = data["weight_map"]["model.norm.weight"]
    data["weight_map"]["model.layers.9.mlp.up_proj.weight"] = shard
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=rf"'model\.layers\.9\.mlp\.up_proj\.weight' in {shard}.*no shard holds it"):
        load_checkpoint(out, verify=False)


def test_inspect_export(export_dir):
    d = inspect_checkpoint(export_dir)
    assert d["format"] == "compress-checkpoint" and d["format_version"] == 1 and d["verified"] is True
    assert d["architecture"] == "LlamaForCausalLM" and d["scheme_counts"] == {"w4a16": 14}
    # asym int4, fp32 scales, group 128: 4 + 32/128 + 4/128 bits plus the 16-byte weight_shape
    lay = d["layers"]["model.layers.0.mlp.up_proj"]
    assert lay["bits_per_weight"] == pytest.approx(4 + 32 / 128 + 4 / 128 + 8 * 16 / (256 * 256), abs=1e-3)
    assert 4.2 < d["bits_per_weight"] < 4.4 and d["bits_per_weight_overall"] > d["bits_per_weight"]
    assert d["parameter_count"] == 512 * 256 * 2 + 14 * 256 * 256 - 4 * 128 * 256 + 5 * 256
    text = format_inspect(d)
    assert "w4a16" in text and "model.safetensors" in text and "all OK" in text
    json.dumps(d)


def test_inspect_reports_checksum_mismatch(export_dir):
    with open(export_dir / "config.json", "a") as f:
        f.write(" ")
    d = inspect_checkpoint(export_dir)
    assert d["verified"] is False and d["files"]["config.json"]["status"] == "mismatch"


# ---------------------------------------------------------------- bad inputs

def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope" / "model")


def test_missing_config(tmp_path, export_dir):
    (export_dir / "config.json").unlink()
    (export_dir / "compress_manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(export_dir)


def test_checksum_mismatch_names_file(export_dir):
    f = export_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: checksum mismatch"):
        load_checkpoint(export_dir)


def test_truncated_safetensors(export_dir):
    f = export_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated or corrupted"):
        load_checkpoint(export_dir, verify=False)


def test_truncated_plain_hf(tmp_path, hf_dir):
    d = tmp_path / "hf"
    shutil.copytree(hf_dir, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_checkpoint(d)


def test_garbage_header(tmp_path, hf_dir):
    d = tmp_path / "hf"
    shutil.copytree(hf_dir, d)
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated or corrupted"):
        load_checkpoint(d)


def test_missing_tensor_plain(tmp_path, hf_dir):
    d = tmp_path / "hf"
    shutil.copytree(hf_dir, d)
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_checkpoint(d)


def test_missing_quantized_tensor(export_dir):
    f = export_dir / "model.safetensors"
    t = load_file(str(f))
    del t["model.layers.0.self_attn.q_proj.weight_scale"]
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.0\.self_attn\.q_proj\.weight_scale'"):
        load_checkpoint(export_dir, verify=False)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_weight_named(tmp_path, tiny_llama, bad):
    cfg, sd = tiny_llama
    sd = dict(sd)
    w = sd["model.layers.0.self_attn.o_proj.weight"].clone()
    w[3, 5] = bad
    sd["model.layers.0.self_attn.o_proj.weight"] = w
    out = export_checkpoint(tmp_path / "n", cfg, sd, {})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight'.*NaN/Inf"):
        load_checkpoint(out)


def test_nan_in_scale_named(tmp_path, tiny_llama):
    cfg, sd = tiny_llama
    dense, q = split_model(sd, {"model.layers.1.mlp.gate_proj": w8a8_rtn})
    q["model.layers.1.mlp.gate_proj"].tensors["weight_scale"][0] = float("nan")
    out = export_checkpoint(tmp_path / "n", cfg, dense, q)
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight_scale'.*NaN/Inf"):
        load_checkpoint(out)


def test_unknown_format_version(export_dir):
    m = export_dir / "compress_manifest.json"
    man = json.loads(m.read_text())
    man["format_version"] = 99
    m.write_text(json.dumps(man))
    with pytest.raises(CheckpointError, match="unknown format version 99"):
        load_checkpoint(export_dir)


def test_pickle_only_dir_refused(tmp_path, hf_dir):
    d = tmp_path / "pt"
    d.mkdir()
    shutil.copy(hf_dir / "config.json", d / "config.json")
    (d / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match="pickle weights.*never unpickles"):
        load_checkpoint(d)


def test_unsupported_quantization_config(tmp_path, hf_dir):
    d = tmp_path / "awq"
    shutil.copytree(hf_dir, d)
    c = json.loads((d / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match="config.json: quantization method 'gptq' is not supported"):
        load_checkpoint(d)


W4A16 = {"format": "pack-quantized", "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
          "input_activations": None}
W8A8 = {"format": "int-quantized", "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True, "strategy": "token"}}


def _ct(group: dict, **top) -> dict:
    return {"quant_method": "compressed-tensors", "format": group["format"], "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], **group}}, **top}


@pytest.mark.parametrize("qc, message", [
    (_ct({**W8A8, "input_activations": None}), "W8A16"),
    (_ct({**W8A8, "format": "pack-quantized"}), r"pack-quantized, W8A16"),
    (_ct({**W4A16, "format": "int-quantized"}), "only pack-quantized"),
    (_ct({**W4A16, "input_activations": W8A8["input_activations"]}), "W4A8"),
    (_ct({**W8A8, "weights": {**W8A8["weights"], "strategy": "group", "group_size": 128}}), "only per channel"),
    (_ct({**W8A8, "input_activations": {**W8A8["input_activations"], "dynamic": False, "strategy": "tensor"}}),
     "static"),
    (_ct(W4A16, quantization_status="frozen"), "quantization_status 'frozen'"),
    (_ct(W4A16, sparsity_config={"format": "sparse-24-bitmask"}), "sparse"),
])
def test_compressed_tensors_schemes_read_otherwise_are_refused_by_name(tmp_path, hf_dir, qc, message):
    """A third-party checkpoint in a scheme the runtime does not compute as meant (W8A16
    would run with int8 activations it does not ask for) is refused, naming config.json,
    the group and the scheme; W4A16 and W8A8 as llm-compressor writes them are read."""
    d = tmp_path / "m"
    shutil.copytree(hf_dir, d)
    c = json.loads((d / "config.json").read_text())
    c["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match=message) as err:
        load_checkpoint(d)
    assert "config.json" in str(err.value)


def test_path_that_is_not_a_hub_id(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_path(str(tmp_path / "a" / "b" / "c"))
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_path("./relative/missing/model")


def test_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="could not be fetched from the Hugging Face hub.*HF_HUB_OFFLINE"):
        resolve_model_path("some-org/some-model")
