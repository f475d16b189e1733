"""Scheme codecs and export -> load round trips, per scheme and mixed."""
import json

import pytest
import torch

from compress.io.checkpoint import load_checkpoint
from compress.io.export import export_checkpoint
from compress.io.formats import pack_int4_dim0, unpack_int4_dim0
from io_helpers import (all_linears, assert_qw_equal, int4_rtn, llm_int8_rtn, split_model, w8a8_rtn)


def test_zero_point_packing_matches_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    z = torch.randint(0, 16, (37, 5), dtype=torch.uint8)   # N not a multiple of 8
    ours = pack_int4_dim0(z)
    theirs = pack_to_int32((z.to(torch.int16) - 8).to(torch.int8), 4, packed_dim=0)
    assert ours.shape == (5, 5) and torch.equal(ours, theirs)
    assert torch.equal(unpack_int4_dim0(ours, 37), z)
    back = unpack_from_int32(ours, 4, torch.Size([37, 5]), packed_dim=0)
    assert torch.equal(back.to(torch.int16) + 8, z.to(torch.int16))


def _roundtrip(tmp_path, cfg, sd, schemes):
    dense, quantized = split_model(sd, schemes)
    out = export_checkpoint(tmp_path / "ck", cfg, dense, quantized)
    ck = load_checkpoint(out)
    assert set(ck.quantized) == set(quantized)
    for m, q in quantized.items():
        assert_qw_equal(q, ck.quantized[m])
        for k, v in q.meta.items():
            assert ck.quantized[m].meta[k] == v
    assert set(ck.dense) == set(dense)
    for k in dense:
        assert torch.equal(ck.dense[k], dense[k]), k
    return out, ck, json.loads((out / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_roundtrip(tmp_path, tiny_llama, symmetric):
    cfg, sd = tiny_llama
    out, ck, qc = _roundtrip(tmp_path, cfg, sd, {m: (lambda w: int4_rtn(w, 128, symmetric)) for m in all_linears()})
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"] and "lm_head" in qc["ignore"]
    assert group["weights"] == {**group["weights"], "num_bits": 4, "type": "int", "strategy": "group",
                                "group_size": 128, "symmetric": symmetric}
    assert qc.get("dequantize", False) is (not symmetric)
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        p = "model.layers.0.self_attn.k_proj"
        assert f.get_tensor(f"{p}.weight_packed").dtype == torch.int32
        assert f.get_tensor(f"{p}.weight_packed").shape == (128, 32)
        assert f.get_tensor(f"{p}.weight_scale").shape == (128, 2)
        assert f.get_tensor(f"{p}.weight_shape").tolist() == [128, 256]
        assert (f"{p}.weight_zero_point" in keys) is (not symmetric)
        if not symmetric:
            zp = f.get_tensor(f"{p}.weight_zero_point")
            assert zp.dtype == torch.int32 and zp.shape == (16, 2)
    assert ck.quantized[p].meta["group_size"] == 128


def test_w8a8_roundtrip(tmp_path, tiny_llama):
    cfg, sd = tiny_llama
    out, ck, qc = _roundtrip(tmp_path, cfg, sd, {m: w8a8_rtn for m in all_linears()})
    (group,) = qc["config_groups"].values()
    assert qc["format"] == "int-quantized"
    assert group["weights"]["strategy"] == "channel" and group["weights"]["num_bits"] == 8
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"]
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.int8
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight_scale").shape == (256, 1)


def test_llm_int8_roundtrip(tmp_path, tiny_llama):
    cfg, sd = tiny_llama
    out, ck, qc = _roundtrip(tmp_path, cfg, sd, {m: llm_int8_rtn for m in all_linears()})
    assert qc["quant_method"] == "bitsandbytes" and qc["load_in_8bit"] is True
    assert qc["llm_int8_threshold"] == 6.0 and "lm_head" in qc["llm_int8_skip_modules"]
    from safetensors import safe_open
    p = "model.layers.1.mlp.down_proj"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor(f"{p}.SCB").dtype == torch.float32
        torch.testing.assert_close(f.get_tensor(f"{p}.SCB"), sd[f"{p}.weight"].abs().amax(-1))
        assert f.get_tensor(f"{p}.weight_format").item() == 0
        assert f.get_tensor(f"{p}.outlier_idx").tolist() == [0, 7, 14]


def test_llm_int8_without_outliers(tmp_path, tiny_llama):
    cfg, sd = tiny_llama
    _roundtrip(tmp_path, cfg, sd, {m: (lambda w: llm_int8_rtn(w, n_outliers=0)) for m in all_linears()})


def test_mixed_roundtrip(tmp_path, tiny_llama):
    cfg, sd = tiny_llama
    mods = all_linears()
    schemes = {m: (lambda w: int4_rtn(w, 128, False)) for m in mods[:4]}
    schemes.update({m: (lambda w: int4_rtn(w, 64, True)) for m in mods[4:6]})
    schemes.update({m: w8a8_rtn for m in mods[6:10]})          # mods[10:] stay dense
    _, ck, qc = _roundtrip(tmp_path, cfg, sd, schemes)
    assert qc["format"] == "mixed-precision" and len(qc["config_groups"]) == 3
    assert {g["format"] for g in qc["config_groups"].values()} == {"pack-quantized", "int-quantized"}
    assert set(mods[10:]) <= set(qc["ignore"])
    assert ck.quantized[mods[4]].meta["group_size"] == 64
    assert ck.manifest["layers"][mods[0]]["scheme"] == "w4a16"
    # with llm_int8 in the mix no ecosystem config fits: our own marker
    schemes[mods[10]] = llm_int8_rtn
    _, ck, qc = _roundtrip(tmp_path / "b", cfg, sd, schemes)
    assert qc["quant_method"] == "compress"
    assert ck.schemes[mods[10]] == "llm_int8"


def test_dense_export_has_no_quantization_config(tmp_path, tiny_llama):
    cfg, sd = tiny_llama
    out = export_checkpoint(tmp_path / "d", cfg, sd, {}, dense_dtype=torch.bfloat16)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    ck = load_checkpoint(out)
    assert not ck.quantized and ck.dense["model.norm.weight"].dtype == torch.bfloat16
