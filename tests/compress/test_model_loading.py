"""Loading the model to compress: clear errors for every kind of bad directory."""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from compress.architectures import UnsupportedArchitectureError
from compress.io.checkpoint import CheckpointError
from compress.model_loading import ModelLoadError, load_model_for_compression


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_loads_each_family(tiny_family_dir):
    model, tok, arch, path = load_model_for_compression(str(tiny_family_dir))
    assert arch.model_type == model.config.model_type and not model.training
    assert tok("x").input_ids[0] == tok.bos_token_id


def test_missing_directory():
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model_for_compression("./no/such/model")


def test_unsupported_architecture(tmp_path, tiny_llama_dir):
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match=r"'gpt2'.*config.json.*llama"):
        load_model_for_compression(str(d))


def test_no_config_and_bad_json(tmp_path, tiny_llama_dir):
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: invalid JSON"):
        load_model_for_compression(str(d))
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model_for_compression(str(d))


def test_pickle_only_directory_is_refused(tmp_path, tiny_llama_dir):
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="never unpickles"):
        load_model_for_compression(str(d))


def test_nan_weight_is_named(tmp_path, tiny_llama_dir):
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 4] = float("inf")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model.layers.1.mlp.up_proj.weight.*NaN/Inf"):
        load_model_for_compression(str(d))


def test_truncated_weights(tmp_path, tiny_llama_dir):
    d = copy_model(tiny_llama_dir, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="could not load the weights"):
        load_model_for_compression(str(d))
