"""LLM(w4_activations=...): int4 (w4a16) layers with float activations, the default and the
scheme's numbers (what transformers computes on the same compressed-tensors export), or
with int8 activations per block of 32, the CPU fast path; in prefill and decode steps
over the paged cache, and in the linear forms the native decode step reads."""
from __future__ import annotations

import pytest
import torch

from compress.errors import UserError
from compress.ops import cpu_isa, cpu_isas_available, force_cpu_isa, native_available
from compress.runtime import LLM, layers
from compress.runtime.models.llama import build_model

from paged_steps import fed_token, step_logits
from test_quantized import quantized_pair

PROMPT = [5, 9, 13, 21, 8, 40, 3]
STEPS = 6


def teacher_forced(model) -> tuple[list[int], torch.Tensor]:
    """(the whole sequence, the logits of its prefill and of each decode step) for PROMPT
    followed by step_logits' fixed tokens."""
    logits = step_logits(model, [PROMPT], STEPS)
    tokens = [fed_token(i, 0) for i in range(STEPS)]
    return PROMPT + tokens, torch.cat(logits)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.fixture(scope="module")
def int4_llama(tokenizer):
    """(a checkpoint whose block linears are RTN int4, groups of 32; the HF model holding
    their dequantized weights)."""
    return quantized_pair("llama", "w4a16", len(tokenizer))


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """The HF model's logits at the positions teacher_forced reports."""
    with torch.no_grad():
        out = hf(torch.tensor([ids])).logits[0]
    return out[len(PROMPT) - 1:len(PROMPT) + STEPS]


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
def test_float_activations_are_the_schemes_numbers(int4_llama):
    """The default: prefill and every decode step give the dequantized model's logits to
    fp32 rounding; the int8 fast path visibly does not."""
    ckpt, hf = int4_llama
    model = build_model(ckpt)
    ids, got = teacher_forced(model)
    want = hf_logits(hf, ids)
    assert relative_error(got, want) < 1e-5
    _, fast = teacher_forced(build_model(ckpt, w4_activations="int8"))
    assert relative_error(fast, want) > 1e-3


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
@pytest.mark.parametrize("choice,scheme", [("float", "w4a16_prepared"), ("int8", "w4a8_prepared")])
def test_native_kernels_respect_the_choice(int4_llama, choice, scheme, monkeypatch):
    """The int4 layers hand the native decode step the chosen op (their decode_spec) and
    the native kernels give what the reference kernels give for the same choice (int8 on
    the row-tiled layout here; the lanes layout below)."""
    monkeypatch.setattr(layers, "INT4_LANES", False)
    ckpt, _ = int4_llama
    model = build_model(ckpt, w4_activations=choice)
    linears = [m for layer in model.layers for m in (layer.attn.qkv_proj, layer.attn.o_proj,
                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert {m.decode_spec()[0] for m in linears} == {scheme}
    _, native = teacher_forced(model)
    _, reference = teacher_forced(build_model(ckpt, kernels="reference", w4_activations=choice))
    assert relative_error(native, reference) < 1e-5


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
@pytest.mark.parametrize("choice,scheme", [("float", "w4a16_lanes"), ("int8", "w4a8_lanes")])
def test_int4_layers_take_the_lanes_layout(int4_llama, monkeypatch, choice, scheme):
    """Where int4_lanes_wanted (AVX2 and AVX-512; int8 activations not where AMX is)
    int4 layers are prepared in the lanes layout (decode_spec 'w4a16_lanes' / 'w4a8_lanes'),
    give the reference's logits and the row-tiled kernels' within float rounding, and keep
    their canonical weights recoverable."""
    if not layers.int4_lanes_wanted(choice):
        pytest.skip(f"this CPU runs int4 layers with {choice} activations on the row-tiled layout")
    ckpt, _ = int4_llama
    model = build_model(ckpt, w4_activations=choice)
    linears = [m for layer in model.layers for m in (layer.attn.qkv_proj, layer.attn.o_proj,
                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert {m.decode_spec()[0] for m in linears} == {scheme}
    _, lanes = teacher_forced(model)
    _, reference = teacher_forced(build_model(ckpt, kernels="reference", w4_activations=choice))
    assert relative_error(lanes, reference) < 1e-5
    monkeypatch.setattr(layers, "INT4_LANES", False)
    tiled_model = build_model(ckpt, w4_activations=choice)
    _, tiled = teacher_forced(tiled_model)
    assert relative_error(lanes, tiled) < 1e-5
    tiled_linears = [m for layer in tiled_model.layers for m in (layer.attn.qkv_proj, layer.attn.o_proj,
                                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    for a, b in zip(linears, tiled_linears):
        assert torch.equal(a.canonical_qweight(), b.canonical_qweight())


def test_unknown_choice_is_a_user_error(int4_llama):
    with pytest.raises(UserError, match="w4_activations: unknown activation precision 'int4'"):
        LLM.from_checkpoint(int4_llama[0], w4_activations="int4")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
def test_float_activations_match_transformers_on_the_export(tmp_path, int4_llama, tokenizer):
    """The export loaded by transformers + compressed-tensors and by our runtime: the same
    logits to fp32 rounding with float activations (the default), prefill and decode."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from compress.io.export import export_checkpoint

    ckpt, _ = int4_llama
    out = export_checkpoint(tmp_path / "int4", ckpt.config, ckpt.dense, ckpt.quantized, tokenizer=tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    llm = LLM(out)
    assert llm.w4_activations == "float"
    ids, got = teacher_forced(llm.model)
    assert relative_error(got, hf_logits(hf, ids)) < 1e-5
    assert relative_error(llm.logits([ids])[0], hf(torch.tensor([ids])).logits[0].detach()) < 1e-5


@pytest.mark.skipif(not native_available("cpu") or "avx2" not in cpu_isas_available(),
                    reason="native CPU kernels not built, or no AVX2")
@pytest.mark.parametrize("choice,scheme", [("float", "w4a16_lanes"), ("int8", "w4a8_lanes")])
def test_int4_on_avx2_takes_the_lanes_layout_and_the_avx512_bits(int4_llama, choice, scheme):
    """On an AVX2 CPU int4 layers run the lanes layout too, and their logits are bit for bit
    those of the AVX-512 forms: a sequence decodes to the same bits on either machine,
    alone or batched."""
    ckpt, _ = int4_llama
    with force_cpu_isa("avx2"):
        model = build_model(ckpt, w4_activations=choice)
        _, avx2 = teacher_forced(model)
    assert {m.decode_spec()[0] for m in _int4_linears(model)} == {scheme}
    if cpu_isa() == "avx512_vnni":
        _, avx512 = teacher_forced(model)
        assert torch.equal(avx2, avx512)


@pytest.mark.skipif(not native_available("cpu") or "avx2" not in cpu_isas_available(),
                    reason="native CPU kernels not built, or no AVX2")
def test_an_avx2_cap_takes_the_lanes_layout_on_an_amx_cpu(monkeypatch):
    """The AMX tiles run only where AVX-512 is the active ISA (w4a8_gemm.cpp), so under an
    AVX2 cap a CPU with AMX-BF16 takes the lanes layout for int8 activations, as an AVX2
    CPU does; with AVX-512 active it keeps the row-tiled layout the tiles read."""
    monkeypatch.setattr(layers, "w4a16_amx_available", lambda: True)
    with force_cpu_isa("avx2"):
        assert layers.int4_lanes_wanted("int8") and layers.int4_lanes_wanted("float")
    if cpu_isa() == "avx512_vnni":
        assert not layers.int4_lanes_wanted("int8") and layers.int4_lanes_wanted("float")


def _int4_linears(model):
    return [m for layer in model.layers for m in (layer.attn.qkv_proj, layer.attn.o_proj,
                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)]
