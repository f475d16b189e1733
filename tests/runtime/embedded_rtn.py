"""Helpers for the end-to-end runtime tests on the embedded model: an RTN export of it,
and the check that another kernel path follows the reference ops' greedy choices."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from compress.io.export import export_checkpoint
from compress.state import CompressionState, StepContext
from quantizers.rtn import RTNConfig, apply_rtn

# openings of the kind of text the embedded model was trained on (pydoc)
PROMPTS = ["Return the number of", "This module provides", "If the file", "Raise ValueError if"]


def export_rtn(embedded, bits: int, out: Path) -> Path:
    """The embedded model (``load_model_for_compression``'s tuple) quantized by RTN to
    ``bits`` and exported as a packed checkpoint at ``out``."""
    model, tok, arch, path = embedded
    state = CompressionState(copy.deepcopy(model), arch, tok, str(path))
    apply_rtn(state, RTNConfig(bits=bits), StepContext("test", lambda: None, progress=False))
    dense = {k: v for k, v in state.model.state_dict().items() if k.removesuffix(".weight") not in state.quantized}
    export_checkpoint(out, state.model.config, dense, state.quantized, tokenizer=tok)
    return out


def assert_follows_reference(ref_llm, llm, ref_outputs, label: str, max_err: float = 0.25) -> None:
    """Teacher-forced along the reference's greedy sequences (cache-free forwards of
    both): ``llm``'s logits stay within ``max_err`` of the reference's, and its every
    next-token choice equals the reference's unless the reference's top-2 margin is
    within twice the measured logit error (a near-tie); 95% agree at least."""
    agree = total = 0
    for o in ref_outputs:
        ids = torch.tensor([list(o.prompt_token_ids) + list(o.token_ids)])
        lr, ln = ref_llm.logits(ids)[0].float(), llm.logits(ids)[0].float()
        assert torch.isfinite(ln).all(), f"{label}: non-finite logits"
        err = float((lr - ln).abs().max())
        assert err < max_err, f"{label} logits differ from the reference by {err:.3f}"
        p0 = len(o.prompt_token_ids) - 1
        for i in range(len(o.token_ids)):
            top2 = lr[p0 + i].topk(2).values
            same = int(ln[p0 + i].argmax()) == int(lr[p0 + i].argmax())
            agree, total = agree + same, total + 1
            assert same or float(top2[0] - top2[1]) < 2 * err, \
                f"{label}, prompt {o.prompt_token_ids[:4]}..., step {i}: differs with reference margin " \
                f"{float(top2[0] - top2[1]):.3f}"
    assert agree / total >= 0.95
