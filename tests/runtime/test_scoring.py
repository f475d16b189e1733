"""Scoring helpers used by evals: token log-probs and (context, continuation) likelihoods."""
from __future__ import annotations

import pytest
import torch

from compress.runtime import LLM, Loglikelihood


def _reference_loglikelihood(llm: LLM, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    ids = torch.tensor([ctx + cont])
    logp = llm.logits(ids)[0].log_softmax(-1)
    pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
    tgt = torch.tensor(cont)
    return float(logp[pos, tgt].sum()), bool((logp[pos].argmax(-1) == tgt).all())


def test_loglikelihood_batched_matches_one_by_one(llm):
    reqs = [(llm.encode("The quick brown"), llm.encode(" fox jumps", add_special_tokens=False)),
            (llm.encode("Hello"), llm.encode(" world! Numbers like 12345", add_special_tokens=False)),
            ([0], [5, 6, 7]),
            (llm.encode("def main():\n    print"), [40])]
    results = llm.loglikelihood(reqs, batch_size=3)
    assert all(isinstance(r, Loglikelihood) for r in results)
    for (ctx, cont), r in zip(reqs, results):
        lp, greedy = _reference_loglikelihood(llm, ctx, cont)
        assert abs(r.logprob - lp) < 1e-3 and r.is_greedy == greedy
        logprob, is_greedy = r   # lm-eval's (float, bool)
        assert logprob < 0


def test_loglikelihood_text_and_greedy_flag(llm):
    ctx = llm.encode("Hello world")
    greedy_cont = llm.generate([ctx], _greedy(3))[0].token_ids
    (r,) = llm.loglikelihood([(ctx, greedy_cont)])
    assert r.is_greedy
    (t,) = llm.loglikelihood([("Hello world", llm.decode(greedy_cont))])
    assert isinstance(t.logprob, float)
    (e,) = llm.loglikelihood([("", " Hello")])   # empty context -> BOS
    assert e.logprob < 0


def test_loglikelihood_truncates_long_context(llama_dir):
    small = LLM(llama_dir, max_seq_len=16)
    ctx, cont = list(range(2, 40)), [5, 6, 7]
    (r,) = small.loglikelihood([(ctx, cont)])
    full = (ctx + cont)[:-1][-16:]
    lp = small.logits(torch.tensor([full]))[0].log_softmax(-1)[-3:]
    assert abs(r.logprob - float(lp[torch.arange(3), torch.tensor(cont)].sum())) < 1e-4


def test_token_logprobs_with_padding(llm):
    a, b = list(range(2, 22)), list(range(30, 40))
    ids = torch.zeros(2, 20, dtype=torch.long)
    mask = torch.zeros(2, 20, dtype=torch.long)
    ids[0], mask[0] = torch.tensor(a), 1
    ids[1, :10], mask[1, :10] = torch.tensor(b), 1
    lp = llm.token_logprobs(ids, mask)
    assert lp.shape == (2, 19)
    alone = llm.token_logprobs(torch.tensor([b]))[0]
    torch.testing.assert_close(lp[1, :9], alone, atol=1e-5, rtol=1e-5)
    assert (lp[1, 9:] == 0).all()
    ref = llm.logits(torch.tensor([a]))[0].log_softmax(-1)[:-1].gather(-1, torch.tensor(a[1:])[:, None])[:, 0]
    torch.testing.assert_close(lp[0], ref, atol=1e-5, rtol=1e-5)


def _greedy(n):
    from compress.runtime import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_rows_scores_do_not_depend_on_its_batch(tokenizer, family):
    """Scoring's cache-free forward on a W8A8 model (whose int8 activations amplify any
    last-bit difference upstream): a row's final hidden states scored alone and inside
    right-padded batches of other widths and sizes are the same bits, and its logits agree
    to the dense head's last bits (past 64 rows it runs at::mm). torch's CPU
    scaled_dot_product_attention had split its work by the padded width (the hidden states
    differed in every one of these cases), and a 14-token document of an RTN int8 model
    moved 0.028 nats."""
    from compress.runtime.models.llama import blocked_attention
    from scheme_checkpoints import checkpoint

    llm = LLM.from_checkpoint(checkpoint(family, "w8a8", len(tokenizer)), tokenizer)
    g = torch.Generator().manual_seed(0)
    row = torch.randint(2, len(tokenizer), (15,), generator=g)
    alone = llm.runner.hidden_states(row.unsqueeze(0))[0]
    alone_logits = llm.logits(row.unsqueeze(0))[0]
    for rows, width in ((1, 16), (1, 200), (3, 64), (8, 130)):
        x = torch.randint(2, len(tokenizer), (rows, width), generator=g)
        x[rows // 2, :15] = row
        assert torch.equal(llm.runner.hidden_states(x)[rows // 2, :15], alone), (rows, width)
        torch.testing.assert_close(llm.logits(x)[rows // 2, :15], alone_logits, rtol=0, atol=1e-5)
    # and the blocked attention is softmax attention: against torch's on the same inputs
    q = torch.randn(2, 8, 37, 16, generator=g)
    k, v = torch.randn(2, 2, 37, 16, generator=g), torch.randn(2, 2, 37, 16, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(blocked_attention(q, k, v, None, True), want, rtol=0, atol=2e-6)
