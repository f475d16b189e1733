"""The compressed-tensors library itself reads our exported W4A16 / W8A8 tensors back to
exactly our dequantized weights, and packs those weights back to exactly our stored
tensors: what vLLM / SGLang load from our exports is bit for bit what we wrote.

Each module's tensors are read from the export's safetensors, decompressed with the
library's compressor for the format the export's ``quantization_config`` names (the
scheme built from its config group), compared with ``QuantizedWeight.dequantize``, then
compressed again with our scale and zero point and compared with the stored tensors."""
import json

import pytest
import torch

from compress.io.export import export_checkpoint
from io_helpers import all_linears, int4_rtn, split_model, w8a8_rtn

pytest.importorskip("compressed_tensors")


def _library_scheme(group: dict):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    acts = group.get("input_activations")
    return QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]),
                              input_activations=None if acts is None else QuantizationArgs(**acts))


def _module_tensors(path, module: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        prefix = module + "."
        return {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


def _roundtrip_through_library(tmp_path, tiny_llama, schemes):
    from compressed_tensors.compressors import BaseCompressor
    cfg, sd = tiny_llama
    dense, quantized = split_model(sd, schemes)
    out = export_checkpoint(tmp_path / "ck", cfg, dense, quantized)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    scheme = _library_scheme(group)
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    checked = 0
    for module, qw in quantized.items():
        stored = _module_tensors(out, module)
        ours = qw.dequantize().float()
        theirs = compressor.decompress(dict(stored), scheme)["weight"].float()
        assert theirs.shape == ours.shape, module
        assert torch.equal(theirs, ours), f"{module}: library dequantizes differently"
        recompressed = compressor.compress({**{k: v for k, v in stored.items()
                                               if k in ("weight_scale", "weight_zero_point")},
                                            "weight": theirs, **_unpacked_zero_point(stored, group)}, scheme)
        compared = [name for name in ("weight_packed", "weight", "weight_scale", "weight_zero_point")
                    if name in stored and name in recompressed]
        assert "weight_scale" in compared and ("weight_packed" in compared or "weight" in compared), compared
        for name in compared:
            assert torch.equal(recompressed[name], stored[name]), f"{module}.{name}"
        checked += 1
    assert checked == len(quantized)
    return qc


def _unpacked_zero_point(stored: dict, group: dict) -> dict:
    """The library's compress takes the zero point unpacked (int8, centred on 0)."""
    if "weight_zero_point" not in stored:
        return {}
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    zp = stored["weight_zero_point"]
    scale = stored["weight_scale"]
    return {"weight_zero_point": unpack_from_int32(zp, group["weights"]["num_bits"], scale.shape, packed_dim=0)}


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_w4a16_bit_exact_through_compressed_tensors(tmp_path, tiny_llama, symmetric):
    qc = _roundtrip_through_library(tmp_path, tiny_llama,
                                    {m: (lambda w: int4_rtn(w, 128, symmetric)) for m in all_linears()})
    assert qc["format"] == "pack-quantized"


def test_w8a8_bit_exact_through_compressed_tensors(tmp_path, tiny_llama):
    qc = _roundtrip_through_library(tmp_path, tiny_llama, {m: w8a8_rtn for m in all_linears()})
    assert qc["format"] == "int-quantized"
