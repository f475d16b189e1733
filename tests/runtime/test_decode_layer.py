"""Decode steps through ``compress::decode_layer`` (one native call per layer) against the
module path (``model.fused_decode = False``): same logits at every step, for every linear
scheme the op takes (LLM.int8 with and without its spike guard), with q/k/v biases
(qwen2), a sliding window (mistral), left padding in a batch, and bf16 activations."""
from __future__ import annotations

import pytest
import torch

from compress.io.schemes import QuantizedWeight
from compress.ops import native_available
from compress.runtime.loading import RuntimeCheckpoint
from compress.runtime.model_runner import ModelRunner
from compress.runtime.models.llama import build_model

from runtime_models import hf_model, tiny_config
from test_quantized import quantized_pair

pytestmark = pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")


# the spike guard's threshold of "llm_int8_guarded": low enough that this model's
# activations spike past it in every step
GUARD_THRESHOLD = 1.0


def checkpoint(family: str, scheme: str, vocab: int, **overrides):
    """``scheme``: dense, w4a16, w8a8, llm_int8 (static outlier set only) or
    llm_int8_guarded (the same with the spike guard at GUARD_THRESHOLD)."""
    if scheme == "dense":
        model = hf_model(tiny_config(family, vocab, **overrides))
        return RuntimeCheckpoint(model.config, {k: v.clone() for k, v in model.state_dict().items()}, {})
    ckpt, _ = quantized_pair(family, scheme.removesuffix("_guarded"), vocab)
    if overrides:
        ckpt.config.update(overrides)
    if scheme.startswith("llm_int8"):
        meta = {"threshold": GUARD_THRESHOLD} if scheme == "llm_int8_guarded" else {}
        ckpt.quantized = {k: QuantizedWeight(q.scheme, q.tensors, meta) for k, q in ckpt.quantized.items()}
    return ckpt


def step_logits(model, prompts: list[list[int]], steps: int, fused: bool, kv_dtype=None) -> list[torch.Tensor]:
    """Logits of the prefill and of ``steps`` decode steps that feed fixed tokens."""
    model.fused_decode = fused
    runner = ModelRunner(model, kv_dtype)
    out = [runner.prefill(prompts, max(len(p) for p in prompts) + steps)]
    for i in range(steps):
        out.append(runner.decode(torch.tensor([(7 * i + 3 * r) % 50 + 2 for r in range(len(prompts))])))
    return out


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 5})],
                         ids=["llama", "qwen2", "mistral-window"])
@pytest.mark.parametrize("scheme", ["dense", "w4a16", "w8a8", "llm_int8", "llm_int8_guarded"])
def test_fused_decode_matches_module_path(tokenizer, family, overrides, scheme):
    model = build_model(checkpoint(family, scheme, len(tokenizer), **overrides))
    assert all(layer.decode_args is not None for layer in model.layers) and model.fused_decode
    prompts = [[5, 9, 13, 21, 8, 40, 3], [11, 4, 7]]  # the second row is left-padded
    got = step_logits(model, prompts, 9, fused=True)
    want = step_logits(model, prompts, 9, fused=False)
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")


def test_fused_decode_in_bfloat16(tokenizer):
    model = build_model(checkpoint("qwen2", "w8a8", len(tokenizer)), dtype=torch.bfloat16)
    assert all(layer.decode_args is not None for layer in model.layers)
    got = step_logits(model, [[5, 9, 13, 21]], 6, fused=True)
    want = step_logits(model, [[5, 9, 13, 21]], 6, fused=False)
    for g, w in zip(got, want):  # elementwise steps round where the module path rounds
        torch.testing.assert_close(g, w, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8"])
def test_float16_kv_cache(tokenizer, scheme):
    """A float16 KV cache: the fused op and the module path store and read the same
    rounded keys and values (same logits), and the rounding moves the logits only a little
    from the fp32 cache's."""
    model = build_model(checkpoint("llama", scheme, len(tokenizer)))
    prompts = [[5, 9, 13, 21, 8, 40, 3], [11, 4, 7]]
    got = step_logits(model, prompts, 9, fused=True, kv_dtype=torch.float16)
    want = step_logits(model, prompts, 9, fused=False, kv_dtype=torch.float16)
    exact = step_logits(model, prompts, 9, fused=True)
    for step, (g, w, e) in enumerate(zip(got, want, exact)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
        assert 0 < (g - e).abs().max() < 0.05 * e.abs().max()


def test_layers_the_op_cannot_take_keep_the_module_path(tokenizer):
    plain = checkpoint("llama", "w8a8", len(tokenizer))
    assert all(layer.decode_args is None for layer in build_model(plain, kernels="reference").layers)
    assert all(layer.decode_args is None for layer in build_model(plain, fuse=False).layers)
