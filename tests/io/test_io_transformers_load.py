"""transformers (+ compressed-tensors) loads our exports and computes what our dequantized weights do."""
import pytest
import torch

from compress.io.checkpoint import load_checkpoint
from compress.io.export import export_checkpoint
from io_helpers import all_linears, dequantize, int4_rtn, split_model, w8a8_rtn

pytest.importorskip("compressed_tensors")
pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")]


def _reference_logits(cfg, dense, quantized, ids):
    from transformers import LlamaForCausalLM
    ref = LlamaForCausalLM(cfg).eval()
    sd = dict(dense)
    sd.update({f"{m}.weight": dequantize(q) for m, q in quantized.items()})
    ref.load_state_dict(sd, strict=True)
    with torch.no_grad():
        return ref(ids).logits


def _hf_logits(path, ids, **kw):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return model(ids).logits


def _export(tmp_path, tiny_llama, schemes):
    cfg, sd = tiny_llama
    dense, quantized = split_model(sd, schemes)
    out = export_checkpoint(tmp_path / "ck", cfg, dense, quantized)
    # what our loader reads back is what the reference uses (so it also stands for our runtime)
    ck = load_checkpoint(out)
    return cfg, out, ck.dense, ck.quantized


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_w4a16_loads_in_transformers(tmp_path, tiny_llama, symmetric):
    cfg, out, dense, quantized = _export(
        tmp_path, tiny_llama, {m: (lambda w: int4_rtn(w, 128, symmetric)) for m in all_linears()})
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = _reference_logits(cfg, dense, quantized, ids)
    got = _hf_logits(out, ids)    # plain from_pretrained, no extra arguments
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # and with decompression at load time requested explicitly
    from transformers import CompressedTensorsConfig
    got = _hf_logits(out, ids, quantization_config=CompressedTensorsConfig(dequantize=True))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_w8a8_loads_in_transformers(tmp_path, tiny_llama):
    cfg, out, dense, quantized = _export(tmp_path, tiny_llama, {m: w8a8_rtn for m in all_linears()})
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    ref = _reference_logits(cfg, dense, quantized, ids)
    from transformers import CompressedTensorsConfig
    # decompressed at load: exactly our dequantized weights, activations left in float
    got = _hf_logits(out, ids, quantization_config=CompressedTensorsConfig(dequantize=True))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # default route: compressed-tensors also fake-quantizes activations per token (its int8 grid
    # is absmax/127.5, ours absmax/127), so compare by signal-to-noise ratio
    got = _hf_logits(out, ids)
    snr = 10 * torch.log10(ref.pow(2).mean() / (got - ref).pow(2).mean())
    assert snr > 25, f"SNR {snr:.1f} dB"


def test_quantized_lm_head_is_not_listed_as_ignored(tmp_path, tiny_llama):
    """An int8 lm_head (as the end-to-end benchmark exports) is quantized in the config too:
    transformers then loads it instead of failing on an int8 tensor it expected dense."""
    cfg, out, dense, quantized = _export(tmp_path, tiny_llama, {m: w8a8_rtn for m in all_linears() + ["lm_head"]})
    import json
    assert "lm_head" not in json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    ref = _reference_logits(cfg, dense, quantized, ids)
    from transformers import CompressedTensorsConfig
    got = _hf_logits(out, ids, quantization_config=CompressedTensorsConfig(dequantize=True))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_mixed_w4a16_w8a8_loads_in_transformers(tmp_path, tiny_llama):
    # symmetric int4 + w8a8 + dense through the default (compressed) route. Mixed with
    # *asymmetric* int4 does not load in transformers 5.23 (see compress/io/formats.py).
    mods = all_linears()
    schemes = {m: (lambda w: int4_rtn(w, 128, True)) for m in mods[:7]}
    schemes.update({m: (lambda w: int4_rtn(w, 64, True)) for m in mods[7:10]})
    schemes.update({m: w8a8_rtn for m in mods[10:12]})
    cfg, out, dense, quantized = _export(tmp_path, tiny_llama, schemes)
    ids = torch.randint(0, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
    ref = _reference_logits(cfg, dense, quantized, ids)
    got = _hf_logits(out, ids)
    snr = 10 * torch.log10(ref.pow(2).mean() / (got - ref).pow(2).mean())
    assert snr > 30, f"SNR {snr:.1f} dB"  # w8a8 activations are fake-quantized by compressed-tensors


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("intermediate", [172, 256], ids=["mlp172", "mlp256"])
def test_per_channel_w4a16_loads_in_transformers(tmp_path, symmetric, intermediate):
    """compressed-tensors' channel strategy, including a K (172) that is not a multiple of 8."""
    from transformers import LlamaForCausalLM
    from io_helpers import int4_per_channel, tiny_llama_config
    torch.manual_seed(0)
    cfg = tiny_llama_config(intermediate_size=intermediate)
    sd = {k: v.detach().clone() for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    cfg, out, dense, quantized = _export(
        tmp_path, (cfg, sd), {m: (lambda w: int4_per_channel(w, symmetric)) for m in all_linears()})
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    ref = _reference_logits(cfg, dense, quantized, ids)
    torch.testing.assert_close(_hf_logits(out, ids), ref, rtol=1e-4, atol=1e-4)
