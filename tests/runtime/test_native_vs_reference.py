"""End to end on the embedded model: greedy output of the native CPU kernels equals the
reference ops' (int4 with its int8 activation blocks, and W8A8)."""
import copy

import pytest

from compress.io.export import export_checkpoint
from compress.model_loading import load_model_for_compression
from compress.ops import native_available
from compress.runtime import LLM, SamplingParams
from compress.state import CompressionState, StepContext
from quantizers.rtn import RTNConfig, apply_rtn

PROMPTS = ["Return the number of", "This module provides", "If the file", "Raise ValueError if"]


@pytest.fixture(scope="module")
def embedded(repo_root):
    return load_model_for_compression(str(repo_root / "models" / "pydoc-llama"))


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
@pytest.mark.parametrize("bits", [4, 8])
def test_greedy_native_equals_reference_on_embedded_model(tmp_path, embedded, bits):
    model, tok, arch, path = embedded
    state = CompressionState(copy.deepcopy(model), arch, tok, str(path))
    apply_rtn(state, RTNConfig(bits=bits), StepContext("test", lambda: None, progress=False))
    dense = {k: v for k, v in state.model.state_dict().items() if k.removesuffix(".weight") not in state.quantized}
    export_checkpoint(tmp_path / "q", state.model.config, dense, state.quantized, tokenizer=tok)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ref = LLM(tmp_path / "q", kernels="reference").generate(PROMPTS, params)
    nat = LLM(tmp_path / "q", kernels="native").generate(PROMPTS, params)
    assert [o.token_ids for o in nat] == [o.token_ids for o in ref]
