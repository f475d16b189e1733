"""Tiny Llama / Qwen2 / Mistral checkpoints in every linear scheme the runtime runs, for
the tests that compare the runtime's paths."""
from __future__ import annotations

from compress.io.schemes import QuantizedWeight
from compress.runtime.loading import RuntimeCheckpoint

from runtime_models import hf_model, tiny_config
from test_quantized import quantized_pair

# the spike guard's threshold of "llm_int8_guarded": low enough that this model's
# activations spike past it in every step
GUARD_THRESHOLD = 1.0
SCHEMES = ("dense", "w4a16", "w8a8", "llm_int8", "llm_int8_guarded")


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
