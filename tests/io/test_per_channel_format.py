"""Per-channel int4 on disk: compressed-tensors' ``channel`` strategy (``weight_scale``
[N, 1], ``group_size`` null), K not a multiple of 8 packed as ``pack_to_int32`` pads it,
and read back the same."""
import json

import pytest
import torch

from compress.io.checkpoint import load_checkpoint
from compress.io.export import export_checkpoint
from compress.io.formats import CheckpointFormatError, decode_quantized, encode_quantized
from io_helpers import all_linears, assert_qw_equal, int4_per_channel, int4_rtn, split_model, tiny_llama_config


@pytest.fixture(scope="module")
def mlp_172():
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    cfg = tiny_llama_config(intermediate_size=172)
    return cfg, {k: v.detach().clone() for k, v in LlamaForCausalLM(cfg).state_dict().items()}


@pytest.mark.parametrize("symmetric", [False, True])
def test_packing_matches_compressed_tensors_for_k_172(symmetric):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compress.ops.reference import unpack_int4
    qw = int4_per_channel(torch.randn(12, 172), symmetric)
    packed = qw.tensors["qweight"]
    codes = unpack_int4(packed)[:, :172]
    theirs = pack_to_int32((codes.to(torch.int16) - 8).to(torch.int8), 4)
    assert packed.shape == theirs.shape == (12, 22) and torch.equal(packed, theirs)
    back = unpack_from_int32(packed, 4, torch.Size([12, 172]))
    assert torch.equal(back.to(torch.int16) + 8, codes.to(torch.int16))


def _roundtrip(tmp_path, cfg, sd, schemes):
    dense, quantized = split_model(sd, schemes)
    out = export_checkpoint(tmp_path / "ck", cfg, dense, quantized)
    ck = load_checkpoint(out)
    for m, q in quantized.items():
        assert_qw_equal(q, ck.quantized[m])
        assert ck.quantized[m].meta == q.meta
        assert torch.equal(ck.quantized[m].dequantize(), q.dequantize())
    return out, ck, json.loads((out / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_channel_strategy_roundtrip_with_mlp_172(tmp_path, mlp_172, symmetric):
    cfg, sd = mlp_172
    out, ck, qc = _roundtrip(tmp_path, cfg, sd, {m: (lambda w: int4_per_channel(w, symmetric)) for m in all_linears()})
    # layers of K 256 and K 172 form one config group: per channel, whatever K
    (group,) = qc["config_groups"].values()
    assert qc["format"] == "pack-quantized" and group["targets"] == ["Linear"]
    assert group["weights"]["strategy"] == "channel" and group["weights"]["group_size"] is None
    assert group["weights"]["symmetric"] is symmetric and qc.get("dequantize", False) is (not symmetric)
    from safetensors import safe_open
    p = "model.layers.1.mlp.down_proj"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor(f"{p}.weight_packed").shape == (256, 22)
        assert f.get_tensor(f"{p}.weight_shape").tolist() == [256, 172]
        assert f.get_tensor(f"{p}.weight_scale").shape == (256, 1)
        if not symmetric:
            assert f.get_tensor(f"{p}.weight_zero_point").shape == (32, 1)
    assert ck.quantized[p].meta["group_size"] == 172 and ck.quantized[p].meta["strategy"] == "channel"


def test_channel_beside_group_is_mixed_precision(tmp_path, mlp_172):
    cfg, sd = mlp_172
    mods = all_linears()
    schemes = {m: (lambda w: int4_rtn(w, 128, True)) for m in mods if "down_proj" not in m}
    schemes.update({m: (lambda w: int4_per_channel(w, True)) for m in mods if "down_proj" in m})
    _, _, qc = _roundtrip(tmp_path, cfg, sd, schemes)
    assert qc["format"] == "mixed-precision"
    strategies = {g["weights"]["strategy"]: g for g in qc["config_groups"].values()}
    assert set(strategies) == {"group", "channel"}
    assert strategies["channel"]["targets"] == [r"re:^model\.layers\.0\.mlp\.down_proj$",
                                                r"re:^model\.layers\.1\.mlp\.down_proj$"]


def test_checkpoint_without_manifest_reads_as_channel():
    """A compressed-tensors checkpoint of another tool: one scale column, K from weight_shape."""
    qw = int4_per_channel(torch.randn(16, 172))
    local = {k.rpartition(".")[2]: v for k, v in encode_quantized("m", qw).items()}
    back = decode_quantized("m", "w4a16", local)
    assert back.meta == {"group_size": 172, "in_features": 172, "strategy": "channel"}
    assert torch.equal(back.dequantize(), qw.dequantize())
    local["weight_shape"] = torch.tensor([16, 180])   # 180 needs 23 words, not 22
    with pytest.raises(CheckpointFormatError, match=r"'m\.weight_shape' \[16, 180\] does not match weight_packed"):
        decode_quantized("m", "w4a16", local)


def test_inspect_reports_the_true_k_of_a_per_channel_layer(tmp_path, mlp_172):
    """The packed words round K = 172 up to 176; inspect reports 172 and bits per weight over it."""
    from compress.io.inspect import inspect_checkpoint

    cfg, sd = mlp_172
    dense, q = split_model(sd, {m: int4_per_channel for m in all_linears()})
    info = inspect_checkpoint(export_checkpoint(tmp_path / "m", cfg, dense, q))
    layer = info["layers"]["model.layers.0.mlp.down_proj"]
    assert layer["shape"] == [256, 172]
    assert layer["bits_per_weight"] == round(8 * layer["bytes"] / (256 * 172), 4)
