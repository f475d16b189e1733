"""An llm_int8 export loads in transformers + bitsandbytes (its own LLM.int8() on CPU),
and its logits are close to our runtime's."""
import copy

import pytest
import torch

from compress.io.export import export_checkpoint
from compress.model_loading import load_model_for_compression
from compress.runtime import LLM
from compress.state import CompressionState, StepContext
from quantizers.llm_int8 import LLMInt8Config, apply_llm_int8
from compress.accuracy import sqnr_db


@pytest.mark.slow
def test_llm_int8_export_loads_in_transformers_bitsandbytes(tmp_path, tiny_llama_dir):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    model, tok, arch, path = load_model_for_compression(str(tiny_llama_dir))
    state = CompressionState(copy.deepcopy(model), arch, tok, str(path))
    ids = torch.randint(2, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    apply_llm_int8(state, LLMInt8Config(threshold=2.5), StepContext("t", lambda: ids, progress=False))
    kept = [q.tensors["outlier_idx"].numel() for q in state.quantized.values()]
    assert 0 < sum(kept) < sum(q.tensors["qweight"].shape[1] for q in state.quantized.values())
    dense = {k: v for k, v in state.model.state_dict().items() if k.removesuffix(".weight") not in state.quantized}
    export_checkpoint(tmp_path / "q", state.model.config, dense, state.quantized, tokenizer=tok)

    bnb_model = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert type(bnb_model.model.layers[0].mlp.down_proj).__name__ == "Linear8bitLt"
    x = torch.randint(2, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = bnb_model(x).logits.float()
        fp = model(x).logits
    ours = LLM(tmp_path / "q", kernels="reference").logits(x)
    # bitsandbytes runs in fp16 with its own dynamic outlier split; ours keeps calibrated columns
    assert sqnr_db(ours, theirs) > 30
    assert sqnr_db(fp, ours) > 30
