"""Speculative decoding in the engine (``compress/runtime/speculative/``): lossless.

Greedy outputs with speculation equal those without for k in {1, 3, 5} and three drafts
-- the target itself (every draft token kept), a random-weight model (almost none kept)
and a student made by our own pipeline (depth prune + distill + int4) -- and for prompt
lookup; stops, EOS and max_tokens end a sequence where plain decoding does even inside an
accepted run; any schedule (arrivals, batch caps, pools small enough to preempt) gives
each request its tokens alone; blocks of both caches all come back; sampling follows the
target's distribution (chi-square on a tiny-vocabulary model) with the acceptance rate
sum min(p, q); seeded runs repeat."""
from __future__ import annotations

import math
import random

import pytest
import torch
import yaml

from compress.runtime import LLM, LLMEngine, SamplingParams
from compress.runtime.speculative import ModelDrafter, NgramDrafter, SpeculativeConfig, SpeculativeDecoder
from runtime_models import hf_model, save_model, tiny_config

PROMPTS = ["The quick brown fox", "Python is a", "def main():\n", "A list is a mutable", "Hello world! Numbers"]


@pytest.fixture(scope="module")
def target(llama_dir):
    return LLM(llama_dir)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, tokenizer):
    path, _ = save_model(tmp_path_factory.mktemp("random-draft"), "llama", tokenizer, seed=5)
    return path


@pytest.fixture(scope="module")
def pipeline_draft(tmp_path_factory, llama_dir):
    """The target depth-pruned to one block, healed by KD from it and quantized to int4,
    by ``compress run``'s stages."""
    from compress.pipeline import compress_stages
    from compress.recipe import load_recipe
    from runtime_models import CORPUS

    tmp = tmp_path_factory.mktemp("pipeline-draft")
    (tmp / "train.txt").write_text("\n".join(CORPUS * 4))
    doc = {"name": "draft", "seed": 0, "model": {"path": str(llama_dir)},
           "calibration": {"files": ["train.txt"], "samples": 4, "seq_len": 32},
           "training": {"files": ["train.txt"], "tokens": 32 * 4 * 24, "seq_len": 32},
           "stages": [{"name": "pruned", "steps": [{"method": "prune", "targets": {"num_hidden_layers": 1}}]},
                      {"name": "healed", "from": "pruned",
                       "steps": [{"method": "distill", "teacher": "base", "batch_size": 4, "lr": 3e-3,
                                  "eval_every": 0, "held_out_windows": 2, "checkpoint_every": 0}]},
                      {"name": "int4", "from": "healed", "steps": [{"method": "rtn", "bits": 4, "group_size": 32}]}],
           "export": {"output": "out"}}
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(doc))
    _, results = compress_stages(load_recipe(tmp / "recipe.yaml"), tmp / "out", progress=False, log=lambda *_: None)
    return tmp / "out" / "int4"


def greedy(max_tokens=24, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def with_spec(llm: LLM, drafter, k: int) -> LLM:
    llm.engine.speculative = SpeculativeDecoder(drafter, k)
    return llm


def spec_llm(path, draft, k: int) -> LLM:
    return LLM(path, speculative={"model": str(draft), "num_speculative_tokens": k})


@pytest.mark.parametrize("draft", ["self", "random", "pipeline", "ngram"])
def test_greedy_output_is_the_targets_for_every_k(target, llama_dir, random_draft, pipeline_draft, draft):
    want = [o.token_ids for o in target.generate(PROMPTS, greedy())]
    path = {"self": llama_dir, "random": random_draft, "pipeline": pipeline_draft}.get(draft)
    llm = LLM(llama_dir, speculative="ngram" if draft == "ngram" else {"model": str(path)})
    drafter = llm.engine.speculative.drafter
    alphas = {}
    for k in (1, 3, 5):
        with_spec(llm, drafter, k)
        got = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
        assert got == want, f"draft {draft}, k={k}"
        stats = llm.engine.stats()
        assert stats["spec_steps"] > 0 and stats["spec_draft_tokens"] > 0
        assert stats["spec_emitted_tokens"] == stats["spec_accepted_tokens"] + stats["spec_rows"]
        assert stats["spec_rejections"] <= sum(stats["spec_accepted_hist"][:k])
        if draft == "self":
            assert stats["spec_rejections"] == 0 and stats["spec_acceptance_per_token"] == 1.0
        alphas[k] = stats["spec_acceptance_rate"]
    if draft == "self":
        assert all(a == 1.0 for a in alphas.values())
    elif draft == "random":
        assert all(a < 0.25 for a in alphas.values()), alphas
    elif draft == "pipeline":
        # a one-block student healed on ~3k tokens of a random target: it agrees with the
        # target's argmax well above the random draft's 0 (measured 0.17 at k = 1)
        assert alphas[1] >= 0.1, alphas
    # every block of both caches is back
    assert llm.engine.block_manager.num_used_blocks == 0
    if draft != "ngram":
        assert drafter.block_manager.num_used_blocks == 0 and not drafter.states


def test_a_penalized_request_is_decoded_without_speculation(target, llama_dir):
    """Penalties make a token's logits depend on the tokens before it, which rejection
    sampling does not model: a step with a penalized row runs as a plain step, so the
    request gets the plain engine's tokens; unpenalized steps still speculate."""
    p = greedy(frequency_penalty=-2.0)
    want = [o.token_ids for o in target.generate(PROMPTS[:2], p)]
    llm = LLM(llama_dir, speculative={"model": str(llama_dir), "num_speculative_tokens": 3})
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], p)] == want
    assert llm.engine.stats()["spec_steps"] == 0
    llm.generate(PROMPTS[:1], greedy(4))
    assert llm.engine.stats()["spec_steps"] > 0


def test_a_biased_request_is_decoded_without_speculation(target, llama_dir):
    """A logit bias changes the target's distribution, which the verify step does not
    apply: a step with a biased row runs as a plain step (the plain engine's tokens)."""
    plain = target.generate(PROMPTS[:1], greedy())[0].token_ids
    p = greedy(logit_bias={plain[0]: -100.0, plain[2]: -100.0})
    want = [o.token_ids for o in target.generate(PROMPTS[:2], p)]
    assert want[0] != plain
    llm = LLM(llama_dir, speculative={"model": str(llama_dir), "num_speculative_tokens": 3})
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], p)] == want
    assert llm.engine.stats()["spec_steps"] == 0


def test_self_draft_keeps_whole_runs(llama_dir):
    llm = spec_llm(llama_dir, llama_dir, 3)
    llm.generate(PROMPTS[:2], greedy(max_tokens=17))
    stats = llm.engine.stats()
    # 16 tokens after the first: four full runs of k + 1 = 4 per prompt
    assert stats["spec_accepted_hist"] == [0, 0, 0, 8] and stats["spec_emitted_tokens"] == 32


def test_stops_inside_an_accepted_run_end_where_plain_decoding_ends(target, llama_dir):
    plain = target.generate(PROMPTS, greedy(max_tokens=20))
    llm = spec_llm(llama_dir, llama_dir, 5)
    for i, out in enumerate(plain):
        ids = out.token_ids
        # a stop token that first occurs mid-way: the run that brings it is cut there
        stop_token = ids[len(ids) // 2]
        for params in (greedy(max_tokens=20, stop_token_ids=[stop_token]),
                       greedy(max_tokens=20, stop=[out.text[len(out.text) // 2:len(out.text) // 2 + 3]]
                              if len(out.text) > 6 else None),
                       greedy(max_tokens=1 + i), greedy(max_tokens=7 + i)):
            want = target.generate([PROMPTS[i]], params)[0]
            got = llm.generate([PROMPTS[i]], params)[0]
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    # EOS honoured (not ignored): the target's EOS set ends runs too
    eos = next(iter(target.eos_token_ids))
    target.eos_token_ids.add(plain[0].token_ids[5])
    llm.eos_token_ids.add(plain[0].token_ids[5])
    try:
        p = SamplingParams(max_tokens=20, temperature=0.0)
        assert llm.generate([PROMPTS[0]], p)[0].token_ids == target.generate([PROMPTS[0]], p)[0].token_ids
    finally:
        target.eos_token_ids.discard(plain[0].token_ids[5])
        llm.eos_token_ids.discard(plain[0].token_ids[5])
    assert eos in target.eos_token_ids


def test_logprobs_are_the_targets(target, llama_dir):
    params = greedy(max_tokens=12, logprobs=3)
    want = target.generate(PROMPTS[:2], params)
    got = spec_llm(llama_dir, llama_dir, 3).generate(PROMPTS[:2], params)
    for a, b in zip(got, want):
        assert [lp.token_id for lp in a.logprobs] == [lp.token_id for lp in b.logprobs]
        for x, y in zip(a.logprobs, b.logprobs):
            assert math.isclose(x.logprob, y.logprob, abs_tol=1e-4)
            assert x.top.keys() == y.top.keys()


@pytest.mark.parametrize("seed", range(4))
def test_any_schedule_gives_each_request_its_tokens_alone(target, random_draft, pipeline_draft, seed):
    from test_llm_engine import alone, random_requests, run

    rng = random.Random(100 + seed)
    model = target.model
    reqs = random_requests(rng, model.vocab_size, rng.randrange(2, 7))
    longest = max(len(p) + sp.max_tokens for _, p, sp in reqs)
    block_size = rng.choice([1, 2, 4, 16])
    tiny_pool = seed % 2 == 0   # only just room for the longest request: preemptions, fewer draft slots
    draft = LLM(pipeline_draft if seed < 2 else random_draft).model
    engine = LLMEngine(model, None, (), 0, block_size=block_size,
                       kv_cache_tokens=longest + block_size if tiny_pool else None,
                       max_num_batched_tokens=rng.choice([3, 8, 64]), max_num_seqs=rng.randrange(1, 6),
                       enable_prefix_caching=seed % 3 == 0)
    drafter = ModelDrafter(draft, longest + 8 if tiny_pool else 4096, block_size)
    engine.speculative = SpeculativeDecoder(drafter, rng.choice([1, 2, 4]))
    arrivals = [rng.randrange(0, 8) for _ in reqs]
    assert run(engine, reqs, arrivals) == alone(model, reqs)
    assert engine.block_manager.num_used_blocks == 0 and drafter.block_manager.num_used_blocks == 0


def test_abort_frees_the_drafts_blocks(llama_dir):
    llm = spec_llm(llama_dir, llama_dir, 3)
    llm.engine.add_request("a", PROMPTS[0], greedy(max_tokens=50))
    for _ in range(3):
        llm.engine.step()
    drafter = llm.engine.speculative.drafter
    assert drafter.block_manager.num_used_blocks > 0
    assert llm.engine.abort("a")
    assert drafter.block_manager.num_used_blocks == 0 and llm.engine.block_manager.num_used_blocks == 0


def test_seeded_sampling_repeats(llama_dir, random_draft):
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_k=50, seed=s, ignore_eos=True) for s in range(3)]
    runs = [[o.token_ids for o in spec_llm(llama_dir, random_draft, 3).generate(PROMPTS[:3], params)]
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_bad_speculative_settings_are_named(llama_dir, tmp_path, tokenizer):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.parse({"model": str(llama_dir), "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.parse({"model": str(llama_dir), "k": 3})
    with pytest.raises(ValueError, match="prompt_lookup"):
        NgramDrafter(max_n=1, min_n=2)
    other = tmp_path / "wider-vocab"
    hf_model(tiny_config("llama", len(tokenizer) + 8)).save_pretrained(other)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(llama_dir, speculative={"model": str(other)})


# ----------------------------------------------------------------------------- distribution

def tiny_vocab_model(tmp_path, seed: int, vocab: int = 8):
    config = tiny_config("llama", vocab, hidden_size=32, intermediate_size=64)
    model = hf_model(config, seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)      # spread the next-token distributions
    path = tmp_path / f"v{vocab}-{seed}"
    model.save_pretrained(path)
    return path


def test_sampled_tokens_follow_the_target_and_alpha_is_sum_of_min(tmp_path):
    """Target and draft: two random models over 8 tokens. The first token comes from the
    prefill, the second from a speculative step with k = 1 (the kept draft token or the
    resampled one): the pair's counts against p(t1) p(t2 | t1) by chi-square, and the
    measured acceptance against E_t1[sum_x min(p, q)]."""
    vocab, n = 8, 2400
    target_path, draft_path = tiny_vocab_model(tmp_path, 0, vocab), tiny_vocab_model(tmp_path, 1, vocab)
    prompt = [3, 1, 4, 1, 5]
    target, draft = LLM(target_path), LLM(draft_path)
    with torch.no_grad():
        p1 = target.logits([prompt])[0, -1].softmax(-1)
        rows = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = target.logits(rows)[:, -1].softmax(-1)          # [t1, t2]
        q2 = draft.logits(rows)[:, -1].softmax(-1)
    joint = p1.unsqueeze(1) * p2
    alpha = float((p1 * torch.minimum(p2, q2).sum(-1)).sum())
    llm = LLM(target_path, max_batch_size=64, speculative={"model": str(draft_path), "num_speculative_tokens": 1})
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    counts = torch.zeros(vocab, vocab)
    for out in llm.generate([prompt] * n, params):
        counts[out.token_ids[0], out.token_ids[1]] += 1
    stats = llm.engine.stats()
    assert stats["spec_draft_tokens"] == n      # one draft token per request (the step after has no room)
    # pool the cells expected to hold fewer than 5 draws into one
    expected = joint.flatten() * n
    small = expected < 5
    obs = torch.cat([counts.flatten()[~small], counts.flatten()[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty: the chi-square quantile at 1 - 1e-4 (z = 3.72)
    limit = dof * (1 - 2 / (9 * dof) + 3.72 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, f"chi2 {chi2:.1f} on {dof} dof (limit {limit:.1f})"
    measured = stats["spec_accepted_tokens"] / n
    sd = math.sqrt(alpha * (1 - alpha) / n)
    assert 0.05 < alpha < 0.95 and abs(measured - alpha) < 4 * sd, (measured, alpha)


def test_a_sliding_window_target_verifies_within_its_window(tmp_path_factory, tokenizer):
    """A Mistral whose window (6) is shorter than the prompts: the verify pass's one-token
    rows each attend to their own last 6 positions, as plain decoding does."""
    path, _ = save_model(tmp_path_factory.mktemp("mistral-spec"), "mistral", tokenizer, sliding_window=6)
    want = [o.token_ids for o in LLM(path).generate(PROMPTS, greedy(max_tokens=20))]
    for k in (2, 4):
        llm = spec_llm(path, path, k)
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy(max_tokens=20))] == want
        assert llm.engine.stats()["spec_acceptance_per_token"] == 1.0


def test_a_bfloat16_target_with_an_int4_draft_keeps_its_greedy_output(llama_dir, pipeline_draft):
    """bf16 activations and weights (the decode plan's dense bf16 GEMM is batch-invariant
    as well), the pipeline's int4 draft loaded in bf16 too."""
    want = [o.token_ids for o in LLM(llama_dir, dtype="bfloat16").generate(PROMPTS, greedy())]
    llm = LLM(llama_dir, dtype="bfloat16", speculative={"model": str(pipeline_draft), "num_speculative_tokens": 3})
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == want
    assert llm.engine.stats()["spec_draft_tokens"] > 0


def test_rows_share_the_free_blocks_when_sized_for_their_drafts(llama_dir, random_draft):
    """Several decode rows under a small pool with a model draft (it always proposes its k):
    each row's room is taken from the pool before the next row's is sized, so the rows
    never claim more blocks than are free together (the step had raised "no free KV block");
    the tokens are still plain decoding's."""
    prompts, params = PROMPTS[:3], [greedy(30)] * 3
    want = [o.token_ids for o in LLM(llama_dir).generate(prompts, params)]
    llm = LLM(llama_dir, speculative={"model": str(random_draft), "num_speculative_tokens": 3}, kv_cache_tokens=64,
              block_size=4, enable_prefix_caching=False)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.block_manager.num_used_blocks == 0


def test_a_draft_with_another_tokenizer_is_refused(llama_dir, random_draft, tmp_path):
    """The same vocabulary size but other ids for its tokens: refused by name (its drafts
    would be verified, and nearly all rejected)."""
    import json
    import shutil

    other = tmp_path / "other-tokenizer-draft"
    shutil.copytree(random_draft, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="tokenizer is not the target's .*2 tokens differ"):
        LLM(llama_dir, speculative={"model": str(other), "num_speculative_tokens": 2})


def test_loglikelihood_names_a_token_outside_the_vocabulary(target):
    with pytest.raises(ValueError, match="request 1: continuation token id 1000000 is outside the vocabulary"):
        target.loglikelihood([([5], [6]), ([5], [10**6])])
