"""The conformance test every quantized layer scheme passes, through the real code paths:

quantizer core -> export -> load (bit-exact round trip) -> the runtime layer on the
reference ops equals ``x @ W_deq.T + b`` -> the runtime layer on the native kernels
matches it -> the whole exported model on our runtime matches transformers running the
dequantized weights -> ``torch.library.opcheck`` of the op the layer calls.

A new scheme (or scheme variant) is one more entry in SCHEMES.
"""
from __future__ import annotations

import pytest
import torch

from compress.accuracy import sqnr_db
from compress.io.checkpoint import load_checkpoint
from compress.io.export import export_checkpoint
from compress.ops import native_available
from compress.runtime import LLM
from compress.runtime.models.llama import CheckpointTensors
from quantizers.outliers import quantize_llm_int8
from quantizers.rtn import RTNConfig, quantize_weight_rtn
from tiny_models import make_tokenizer, tiny_config

BLOCK_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _rtn(**kw):
    config = RTNConfig(**kw)
    return lambda w, name: quantize_weight_rtn(w, config, name)


def _llm_int8(w, name):
    return quantize_llm_int8(w, torch.tensor([3, 17, w.shape[1] - 1]), threshold=6.0)


def _float_activations(x, qw):
    return x


def _int8_per_token(x):
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 127
    return (x / scale).round().clamp(-127, 127) * scale


def _w8a8_activations(x, qw):
    return _int8_per_token(x)


def _llm_int8_activations(x, qw):
    """Outlier columns stay float; the others are per-token int8 with a scale over them alone."""
    idx = qw.tensors["outlier_idx"].long()
    rest = x.clone()
    rest[:, idx] = 0
    out = _int8_per_token(rest)
    out[:, idx] = x[:, idx]
    return out


# id -> (quantize(weight, name), model overrides, what the scheme does to activations,
#        min SQNR in dB of the native kernels against the scheme's reference)
SCHEMES = {
    "w4a16-g64-asym": (_rtn(bits=4, group_size=64), {}, _float_activations, 30.0),
    "w4a16-g32-sym": (_rtn(bits=4, group_size=32, symmetric=True), {}, _float_activations, 30.0),
    "w4a16-channel-k172": (_rtn(bits=4, group_size="channel"), {"intermediate_size": 172}, _float_activations, 30.0),
    "w8a8": (_rtn(bits=8), {}, _w8a8_activations, 30.0),
    "llm_int8": (_llm_int8, {}, _llm_int8_activations, 30.0),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(512).save_pretrained(path)
    return path


def _export(tmp_path, tokenizer_dir, scheme):
    """(export dir, HF model with the dequantized weights, {module: QuantizedWeight})."""
    from transformers import AutoModelForCausalLM

    quantize, overrides, _, _ = SCHEMES[scheme]
    torch.manual_seed(0)
    config = tiny_config("qwen2", **overrides)        # q/k/v biases: the bias path too
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.data.normal_(0, 0.2)
            state[name] = p.detach().clone()
    quantized = {}
    for i in range(config.num_hidden_layers):
        for rel in BLOCK_LINEARS:
            path = f"model.layers.{i}.{rel}"
            qw = quantize(state.pop(f"{path}.weight"), path)
            quantized[path] = qw
            model.get_submodule(path).weight.data.copy_(qw.dequantize())
    out = export_checkpoint(tmp_path / scheme, config, state, quantized, tokenizer=tokenizer_dir)
    return out, model, quantized


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_scheme_conformance(tmp_path, tokenizer_dir, scheme):
    out, hf_model, quantized = _export(tmp_path, tokenizer_dir, scheme)
    _, _, activations, min_db = SCHEMES[scheme]

    # export -> load: the same scheme, meta and tensors, bit for bit
    ckpt = load_checkpoint(out)
    assert set(ckpt.quantized) == set(quantized)
    for path, qw in quantized.items():
        got = ckpt.quantized[path]
        assert got.scheme == qw.scheme and set(got.tensors) == set(qw.tensors), path
        for key, t in qw.tensors.items():
            assert torch.equal(got.tensors[key].to(t.dtype), t), f"{path}.{key}"
        for key in ("group_size", "in_features"):
            assert got.meta.get(key) == qw.meta.get(key), f"{path} meta {key}"

    # the runtime layer on the reference ops is act(x) @ W_deq.T + b, act being what the scheme
    # does to activations (nothing for w4a16, per-token int8 for w8a8, that but for the
    # outlier columns for llm_int8); the native kernels match it
    tensors = CheckpointTensors(ckpt, torch.float32, "cpu")
    x = torch.randn(5, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for path in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        qw = quantized[path]
        bias = ckpt.dense.get(f"{path}.bias")
        xin = torch.randn(5, qw.dequantize().shape[1], generator=torch.Generator().manual_seed(2)) \
            if path.endswith("down_proj") else x
        expected = activations(xin, qw) @ qw.dequantize().T + (0 if bias is None else bias)
        layer = tensors.linear(path)
        layer.prepare("reference")
        torch.testing.assert_close(layer(xin), expected, rtol=1e-5, atol=1e-5)
        torch.library.opcheck(getattr(torch.ops.compress, layer.op_name).default,
                              _op_args(layer, xin), test_utils=("test_schema", "test_faketensor"))
        if native_available("cpu"):
            native = tensors.linear(path)
            native.prepare("native")
            assert sqnr_db(expected, native(xin)) > min_db, path

    # the whole export on our runtime against transformers on W_deq (float activations: exact
    # for w4a16 on the reference ops, within the int8 activations' noise for the others)
    ids = torch.randint(2, 512, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf_model(ids).logits
    exact = activations is _float_activations
    for kernels, db in (("reference", 80.0 if exact else min_db), ("native", min_db)):
        if kernels == "native" and not native_available("cpu"):
            continue
        llm = LLM(str(out), kernels=kernels)
        got = llm.logits(ids)
        assert sqnr_db(want, got) > db, kernels


def _op_args(layer, x):
    """The canonical-layout arguments of ``layer.op_name`` (what the reference op takes)."""
    from compress.runtime.int4_padding import pad_activations

    if layer.scheme == "w4a16":
        return (pad_activations(x, layer.qweight.shape[1] * 8), layer.canonical_qweight(), layer.scales,
                layer.zeros, layer.group_size)
    if layer.scheme == "w8a8":
        return (x, layer.canonical_qweight(), layer.weight_scale)
    return (x, layer.canonical_qweight(), layer.weight_scale, layer.outlier_idx, layer.outlier_weight)
