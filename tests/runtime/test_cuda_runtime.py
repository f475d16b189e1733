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


@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_graph_decode_steps_match_launched_ones(tmp_path, embedded, bits):
    """Decode steps replayed from the CUDA graphs captured at load give the tokens that
    launching the same kernels one by one gives (3 rows: the 4-row graph, padded)."""
    q = export_rtn(embedded, bits, tmp_path / "q")
    opts = dict(device="cuda", dtype="float16", max_batch_size=8, enable_prefix_caching=False)
    graphed, launched = LLM(q, **opts), LLM(q, cuda_graphs=False, **opts)
    assert graphed.runner.graphs is not None and launched.runner.graphs is None
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got, want = graphed.generate(PROMPTS[:3], params), launched.generate(PROMPTS[:3], params)
    assert graphed.engine.stats()["cuda_graph_replays"] == 23
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_int8_kv_cache_on_cuda(tmp_path, embedded):
    """kv_cache_dtype int8 on the GPU: the pools hold int8 rows with their scales, the CUDA
    paged attention kernel reads them (graph replays give the launched tokens), and greedy
    decoding stays near the exact cache's: the chosen tokens' logprobs move by little
    until the first token that differs (a misread scale moves them by whole units)."""
    q = export_rtn(embedded, 4, tmp_path / "q")
    opts = dict(device="cuda", dtype="float16", max_batch_size=8, enable_prefix_caching=False)
    int8, launched, exact = (LLM(q, kv_cache_dtype="int8", **opts),
                             LLM(q, kv_cache_dtype="int8", cuda_graphs=False, **opts), LLM(q, **opts))
    pool = int8.engine.kv_cache.k
    assert pool.dtype == torch.int8 and pool.is_cuda and pool.shape[-1] == int8.model.head_dim + 4
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    got, want = int8.generate(PROMPTS, params), exact.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in launched.generate(PROMPTS, params)]
    assert int8.engine.stats()["cuda_graph_replays"] > 0
    drift, same = [], 0
    for g, w in zip(got, want):
        n = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), len(g.token_ids))
        same += n == len(g.token_ids)
        drift += [abs(a.logprob - b.logprob) for a, b in zip(g.logprobs[:n], w.logprobs[:n])]
    assert drift and max(drift) < 0.2, f"int8 K / V moved a chosen token's logprob by {max(drift):.3f}"
    assert same >= len(PROMPTS) // 2


def test_w4a8_activations_are_refused_on_cuda(tmp_path, embedded):
    q = export_rtn(embedded, 4, tmp_path / "q")
    with pytest.raises(ValueError, match="CPU kernels only"):
        LLM(q, device="cuda", dtype="float16", w4_activations="int8")


def test_int4_layer_converts_its_scales_once():
    """fp32 scales with fp16 activations: converted on the first call, then reused."""
    from compress.ops import reference as ref
    from compress.runtime.layers import Int4Linear
    g = torch.Generator().manual_seed(0)
    n, k, group = 256, 512, 128
    q = ref.pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
    s = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3
    z = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    layer = Int4Linear(q.cuda(), s.cuda(), z.cuda(), group, k)
    layer.prepare("native")
    assert layer.cuda_layout is not None and layer.cuda_layout[1].dtype == torch.float32
    x = torch.randn(3, k, generator=g).half().cuda()
    first = layer(x)
    converted = layer.cuda_scales
    assert converted is not None and converted.dtype == torch.float16
    assert torch.equal(layer(x), first) and layer.cuda_scales is converted
    want = ref.w4a16_gemm(x.cpu(), q, s.half(), z, group)
    torch.testing.assert_close(first.cpu(), want, rtol=1e-2, atol=1e-3)


def test_llm_int8_layer_on_cuda():
    """Outlier weights in fp32 once at load (the epilogue's precision), negative outlier
    indices wrapped, the result the reference's."""
    from compress.ops.reference import w8a8_outlier_gemm
    from compress.runtime.layers import Int8OutlierLinear
    from quantizers.primitives import quantize_int8_per_channel
    g = torch.Generator().manual_seed(1)
    w = torch.randn(128, 256, generator=g) * 0.05
    idx = torch.tensor([-1, 7])
    q, s = quantize_int8_per_channel(w)
    layer = Int8OutlierLinear(q.cuda(), s.cuda(), idx.cuda(), w[:, idx].half().cuda())
    layer.prepare("native")
    assert layer.outlier_weight.dtype == torch.float32 and layer.outlier_idx.tolist() == [255, 7]
    x = torch.randn(5, 256, generator=g).half()
    x[:, [255, 7]] *= 30
    want = w8a8_outlier_gemm(x, q, s, idx, w[:, idx].half())
    torch.testing.assert_close(layer(x.cuda()).cpu(), want, rtol=1e-2, atol=1e-2)
