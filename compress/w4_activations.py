"""How int4 (w4a16) layers treat their activations: the runtime's one table of the choice
(``LLM(w4_activations=...)``, ``--w4-activations``, ``eval.w4_activations``). A leaf
module, so the CLI and the eval config read it without loading the kernels.

* ``"float"``: as the scheme says: activations in the model's dtype, each weight
  dequantized as (u - zero) * scale in fp32, fp32 FMAs (op ``w4a16_gemm[_prepared]``);
  what transformers computes on the same export.
* ``"int8"``: the CPU fast path: activations quantized to int8 per block of 32 along K and
  integer dot products, as llama.cpp's Q4 x Q8 (op ``w4a8_gemm[_prepared]``); faster
  kernels, logits ~0.4% off the scheme's.
"""
from __future__ import annotations

from compress.errors import UserError

W4_ACTIVATIONS = ("float", "int8")
# the default: the scheme's numbers. "int8" decodes faster (1.35x on the embedded model,
# 2x on the 345M bench model, one thread, Zen 4), but is opt-in: the export promises these.
DEFAULT_W4_ACTIVATIONS = "float"


def check_w4_activations(value: str) -> str:
    """``value`` if it is one of :data:`W4_ACTIVATIONS`, else a UserError naming it."""
    if value not in W4_ACTIVATIONS:
        raise UserError(f"w4_activations: unknown activation precision {value!r} for int4 layers; "
                        f"choose one of {list(W4_ACTIVATIONS)}")
    return value
