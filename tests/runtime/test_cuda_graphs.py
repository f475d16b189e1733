"""The CUDA-graph decode step's plumbing (``runtime/cuda_graphs.py``), checked on the CPU
with ``capture_eager``: the static buffers, the batch buckets, rows padded with row 0,
the block tables' width. The capture itself runs on a GPU (tests/runtime/test_cuda_runtime.py)."""
from array import array

import pytest
import torch

from compress.runtime import LLM, SamplingParams
from compress.runtime.cuda_graphs import DecodeGraphs, batch_buckets, capture_eager


def test_buckets_cover_every_batch_up_to_the_largest():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    for m in (3, 17, 64):
        buckets = batch_buckets(m)
        assert buckets == sorted(set(buckets)) and buckets[-1] == m
        assert all(next(b for b in buckets if b >= n) - n < max(8, n) for n in range(1, m + 1))


def _with_eager_graphs(path, max_batch):
    llm = LLM(path, native_decode=False, max_batch_size=max_batch, enable_prefix_caching=False)
    llm.runner.graphs = DecodeGraphs(llm.model, llm.engine.kv_cache, max_batch, capture=capture_eager)
    return llm


@pytest.mark.parametrize("n_prompts", [1, 3, 5])
def test_graph_steps_decode_as_the_module_path_does(llama_dir, n_prompts):
    """Greedy tokens and logprobs of rows decoded through the graph buffers (3 and 5 rows
    run the 4 and 8 buckets, padded with row 0) equal the module path's."""
    prompts = [[5 + i, 17, 3 * i + 2, 40][: 2 + i % 3] for i in range(n_prompts)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    plain = LLM(llama_dir, native_decode=False, max_batch_size=8, enable_prefix_caching=False).generate(prompts, params)
    graphed_llm = _with_eager_graphs(llama_dir, 8)
    graphed = graphed_llm.generate(prompts, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in plain]
    for a, b in zip(graphed, plain):
        got = [lp.logprob for lp in a.logprobs]
        want = [lp.logprob for lp in b.logprobs]
        assert got == pytest.approx(want, abs=1e-4)
    # every decode step replayed (one per generated token after the first, per step)
    assert graphed_llm.runner.graphs.replays == 11
    assert graphed_llm.engine.stats()["cuda_graph_replays"] == 11


def test_padding_rows_leave_other_sequences_alone(llama_dir):
    """A 3-row step runs the 4-row graph: the padding row rewrites row 0's slot with row
    0's own key and value, so a sequence decoded beside others and alone match."""
    llm = _with_eager_graphs(llama_dir, 4)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    together = llm.generate([[7, 8, 9], [10, 11], [12]], params)
    alone = [llm.generate([p], params)[0] for p in ([7, 8, 9], [10, 11], [12])]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_decode_refuses_what_the_graphs_cannot_take(llama_dir):
    llm = _with_eager_graphs(llama_dir, 2)
    graphs = llm.runner.graphs
    with pytest.raises(ValueError, match="1..2 rows"):
        graphs.decode([1, 2, 3], [0, 0, 0], [[0], [1], [2]])
    with pytest.raises(ValueError, match="longer than"):
        graphs.decode([1], [0], [list(range(graphs.width + 1))])


def test_graphs_stay_off_the_cpu(llama_dir):
    assert LLM(llama_dir).runner.graphs is None
    assert LLM(llama_dir, cuda_graphs=False).runner.graphs is None


def test_steps_write_the_tables_that_changed(llama_dir):
    """A step copies the block tables only when one differs from the bucket's last step:
    equal tables are left as they are on the device, a table of the same length with
    another block is written, and so are list tables."""
    llm = _with_eager_graphs(llama_dir, 2)
    graphs = llm.runner.graphs
    inputs = graphs.inputs[2]
    with torch.inference_mode():
        graphs.decode([5, 6], [17, 3], [array("i", [1, 2]), array("i", [3])])
        assert inputs.block_tables[:, :2].tolist() == [[1, 2], [3, 0]]
        inputs.block_tables.fill_(9)   # marks what the device holds (block 9 is in the pool)
        graphs.decode([5, 6], [18, 4], [array("i", [1, 2]), array("i", [3])])
        assert inputs.block_tables[:, :2].tolist() == [[9, 9], [9, 9]]
        graphs.decode([5, 6], [18, 4], [array("i", [1, 4]), array("i", [3])])
        assert inputs.block_tables[:, :2].tolist() == [[1, 4], [3, 0]]   # past a table: what the host held
        inputs.block_tables.fill_(9)
        graphs.decode([5, 6], [18, 4], [[1, 4], [3]])
        assert inputs.block_tables[:, :2].tolist() == [[1, 4], [3, 0]]
        assert inputs.ints.tolist() == [[5, 6], [18, 4], [4, 3], [2, 4], [4 * 16 + 2, 3 * 16 + 4]]   # 16-token blocks
        assert inputs.context_lens.tolist() == [19, 5]
