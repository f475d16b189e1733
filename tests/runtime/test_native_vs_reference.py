"""End to end on the embedded model: greedy output of the native CPU kernels against the
reference ops'. W8A8 quantizes activations exactly as the reference does, so its greedy
output is identical. The native int4 kernel quantizes activations to int8 blocks of 32
(as llama.cpp does): its logits differ from the reference by ~0.1, so greedy decoding
may take the other branch at a near-tie; it must agree everywhere else."""
import pytest
import torch

from compress import ops
from compress.ops import native_available
from compress.runtime import LLM, SamplingParams
from embedded_rtn import PROMPTS, assert_follows_reference, export_rtn

@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
@pytest.mark.parametrize("bits", [4, 8])
def test_greedy_native_equals_reference_on_embedded_model(tmp_path, embedded, bits):
    q = export_rtn(embedded, bits, tmp_path / "q")
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ref_llm, nat_llm = LLM(q, kernels="reference"), LLM(q, kernels="native")
    ref = ref_llm.generate(PROMPTS, params)
    if bits == 8:
        assert [o.token_ids for o in nat_llm.generate(PROMPTS, params)] == [o.token_ids for o in ref]
        return
    # int4: every next-token choice of the native path equals the reference's but at near-ties
    assert_follows_reference(ref_llm, nat_llm, ref, "native int4")


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
def test_int8_forward_same_bits_with_and_without_the_int16_gemm(tmp_path, embedded):
    """A 48-token forward runs its W8A8 linears at M = 48: on AVX2 the int16 GEMM
    (csrc/cpu/w8a8_i16_avx2.inc), or, with its row threshold raised, the byte tiles. The
    logits must be the same bits."""
    llm = LLM(export_rtn(embedded, 8, tmp_path / "q"), kernels="native")
    ids = (torch.arange(48) * 7 % 200 + 5).unsqueeze(0)
    with_int16 = llm.logits(ids)
    before = ops.set_w8a8_int16_min_rows(1 << 62)
    try:
        with_bytes = llm.logits(ids)
    finally:
        ops.set_w8a8_int16_min_rows(before)
    assert torch.isfinite(with_int16).all() and torch.equal(with_int16, with_bytes)


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
@pytest.mark.parametrize("bits", [4, 8])
def test_prompt_chunks_through_the_native_plan_equal_the_module_path(tmp_path, embedded, bits, monkeypatch):
    """A step of prompt chunks (many requests at once, chunks of a small token budget, some
    beside decodes) runs through the native plan as one-token rows; with the plan off for
    such steps (NATIVE_STEP_TOKENS = 0) the module path runs them. The same greedy tokens,
    and the first token's logprob within fp32 sum order (the module path's attention is
    SDPA; with int8 activations a sum-order difference can move an activation across an
    int8 rounding step, one step of a row's absmax / 127, which moved a logprob by 0.011)."""
    import compress.runtime.model_runner as model_runner

    q = export_rtn(embedded, bits, tmp_path / "q")
    llm = LLM(q, kernels="native", max_num_batched_tokens=24)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    native = llm.generate(PROMPTS, params)
    monkeypatch.setattr(model_runner, "NATIVE_STEP_TOKENS", 0)
    module = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in native] == [o.token_ids for o in module]
    for a, b in zip(native, module):
        assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < (1e-3 if bits == 4 else 3e-2)
