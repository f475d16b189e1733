"""The runtime on a GPU, end to end on the embedded model: the packed int4 / int8 layers
run the CUDA kernels (compress._cuda) in fp16, and their logits and greedy choices are
checked against the reference ops on the same GPU, teacher-forced along the reference's
greedy sequences (fp16 rounding differs between the two, so a near-tie may flip).

Runs only where torch.cuda.is_available() and compress._cuda is built."""
import pytest
import torch

from compress.ops import native_available
from compress.runtime import LLM, SamplingParams
from embedded_rtn import PROMPTS, assert_follows_reference, export_rtn

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU runtime test skipped"),
    pytest.mark.skipif(torch.cuda.is_available() and not native_available("cuda"),
                       reason="compress._cuda not built"),
]

@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_kernels_follow_the_reference_on_embedded_model(tmp_path, embedded, bits):
    q = export_rtn(embedded, bits, tmp_path / "q")
    opts = dict(device="cuda", dtype="float16")
    ref_llm, nat_llm = LLM(q, kernels="reference", **opts), LLM(q, kernels="native", **opts)
    if bits == 4:  # the packed layers took the CUDA layout (the tensor-core kernel), not a fallback
        layouts = [m.cuda_layout for m in nat_llm.model.modules() if hasattr(m, "cuda_layout")]
        assert layouts and all(lay is not None for lay in layouts)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = ref_llm.generate(PROMPTS, params)
    assert all(len(o.token_ids) == 24 for o in nat_llm.generate(PROMPTS, params))
    # fp16 rounds differently on the two paths (and in the reference's own cached decode),
    # so the choices are compared on cache-free forwards, near-ties allowed
    assert_follows_reference(ref_llm, nat_llm, ref, f"CUDA int{bits}")
