"""The serving engine: whatever arrives when, in whatever batches, chunk sizes, block
sizes and KV pool sizes (forcing preemption), every request's greedy tokens are the ones
it gets alone, and a seeded request samples what it samples alone; prefix-cache hits
give the logits of misses and skip their compute; abort and finish give every block
back; errors name the problem."""
from __future__ import annotations

import contextlib
import dataclasses
import random

import pytest
import torch

from compress.ops import cpu_isas_available, force_cpu_isa, native_available
from compress.runtime import LLM, LLMEngine, SamplingParams
from runtime_models import save_model
from test_quantized import quantized_pair

VOCAB_LOW = 2


@pytest.fixture(scope="module")
def window_model(tmp_path_factory, tokenizer):
    """A Mistral with a sliding window of 6, shorter than most prompts below."""
    from compress.runtime import LLM
    path, _ = save_model(tmp_path_factory.mktemp("mistral"), "mistral", tokenizer, sliding_window=6)
    return LLM(path).model


def engine_for(model, **kw) -> LLMEngine:
    return LLMEngine(model, None, (), 0, **kw)


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]], arrivals: list[int],
        after_step=None) -> dict:
    """Adds request i before step arrivals[i]; steps until all are done. Token ids by id.
    ``after_step(engine)`` runs after every step."""
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    done, step, pending = {}, 0, list(order)
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            rid, prompt, params = requests[pending.pop(0)]
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            assert out.request_id not in done
            if out.finished:
                done[out.request_id] = out.token_ids
        if after_step is not None:
            after_step(engine)
        step += 1
        assert step < 10_000
    return done


def alone(model, requests) -> dict:
    engine = engine_for(model, enable_prefix_caching=False)
    return {rid: run(engine, [(rid, p, sp)], [0])[rid] for rid, p, sp in requests}


def random_requests(rng: random.Random, vocab: int, n: int, greedy: bool = True):
    shared = [rng.randrange(VOCAB_LOW, vocab) for _ in range(rng.randrange(1, 30))]
    reqs = []
    for i in range(n):
        own = [rng.randrange(VOCAB_LOW, vocab) for _ in range(rng.randrange(1, 40))]
        prompt = shared + own if rng.random() < 0.5 else own   # some share a prefix
        params = SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0 if greedy else 0.9,
                                seed=None if greedy else i, ignore_eos=True)
        reqs.append((f"q{i}", prompt, params))
    return reqs


@pytest.mark.parametrize("seed", range(10))
def test_any_schedule_gives_each_request_its_tokens_alone(llm, seed):
    rng = random.Random(seed)
    model = llm.model
    reqs = random_requests(rng, model.vocab_size, rng.randrange(2, 9))
    longest = max(len(p) + sp.max_tokens for _, p, sp in reqs)
    block_size = rng.choice([1, 2, 4, 16])
    tiny_pool = seed % 3 == 0   # only just room for the longest request: preemptions
    engine = engine_for(model, block_size=block_size,
                        kv_cache_tokens=longest + block_size if tiny_pool else None,
                        max_num_batched_tokens=rng.choice([1, 2, 3, 5, 8, 16, 64]),
                        max_num_seqs=rng.randrange(1, 9), enable_chunked_prefill=seed % 4 != 1,
                        enable_prefix_caching=seed % 2 == 0,
                        max_prefill_tokens_with_decodes=rng.choice([None, 1, 3]))
    arrivals = [rng.randrange(0, 12) for _ in reqs]
    reserve = []
    got = run(engine, reqs, arrivals, after_step=lambda e: reserve.append(e.stats()))
    assert got == alone(model, reqs)
    # KV reserved beyond what the running sequences use: under one block each, every step
    for st in reserve:
        unused, running = st["kv_slots_reserved_unused"], st["running"]
        assert 0 <= unused < running * block_size or unused == running == 0
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0
    assert stats["tokens_generated"] == sum(len(t) for t in got.values())


@pytest.mark.skipif(not native_available("cpu"), reason="native CPU kernels not built")
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("kv", [None, "int8"], ids=["kv_model", "kv_int8"])
def test_int4_requests_get_their_tokens_alone(tokenizer, isa, kv):
    """On an int4 model (float activations, the lanes GEMMs wherever the CPU has AVX2),
    also on the AVX2 kernels of an AVX-512 machine, each request's tokens and their
    logprobs are bit for bit the ones it gets alone: a row's bits never depend on what
    shares its GEMM (the row-tiled kernels differ in the last bits, which tokens alone
    seldom show on a tiny model), nor on how its prompt was chunked (the AVX-512 attention
    kernel for a chunk's rows runs the per-row loops' operations lane by lane). With an
    int8 cache too: each position is quantized alone, whatever it was written with."""
    if isa not in cpu_isas_available() and isa != "native":
        pytest.skip(f"no {isa} here")
    ckpt, _ = quantized_pair("llama", "w4a16", len(tokenizer))
    model = LLM.from_checkpoint(ckpt, tokenizer).model
    if not all(m.decode_spec()[0] == "w4a16_lanes" for layer in model.layers for m in (layer.mlp.down_proj,)):
        pytest.skip("this CPU runs int4 layers on the row-tiled layout")

    def scored(engine, requests, arrivals):
        order = sorted(range(len(requests)), key=lambda i: arrivals[i])
        done, step = {}, 0
        while order or engine.has_unfinished():
            while order and arrivals[order[0]] <= step:
                rid, prompt, params = requests[order.pop(0)]
                engine.add_request(rid, prompt, params)
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (out.token_ids, [lp.logprob for lp in out.logprobs])
            step += 1
        return done

    with contextlib.nullcontext() if isa == "native" else force_cpu_isa(isa):
        for seed in (0, 1):
            rng = random.Random(seed)
            reqs = [(rid, p, dataclasses.replace(sp, logprobs=0))
                    for rid, p, sp in random_requests(rng, model.vocab_size, 6)]
            engine = engine_for(model, block_size=4, max_num_batched_tokens=rng.choice([3, 16, 64]), max_num_seqs=6,
                                kv_cache_dtype=kv)
            got = scored(engine, reqs, [rng.randrange(0, 6) for _ in reqs])
            for rid, p, sp in reqs:
                single = engine_for(model, enable_prefix_caching=False, kv_cache_dtype=kv)
                assert got[rid] == scored(single, [(rid, p, sp)], [0])[rid]


def test_a_tiny_pool_preempts_and_still_gives_the_same_tokens(llm):
    model = llm.model
    rng = random.Random(7)
    reqs = [(f"p{i}", [rng.randrange(VOCAB_LOW, 300) for _ in range(20)],
             SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for i in range(4)]
    engine = engine_for(model, block_size=4, kv_cache_tokens=48, max_num_batched_tokens=64)
    assert run(engine, reqs, [0, 0, 0, 0]) == alone(model, reqs)
    assert engine.stats()["num_preemptions"] > 0 and engine.stats()["kv_blocks_used"] == 0


def recomputed_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``, each from a cache-free forward over the whole
    history so far."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0))
        ids.append(int(model.logits(hidden[:, -1]).argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("budget", [1, 3, 16])
def test_sliding_window_with_chunked_prefill(window_model, budget):
    rng = random.Random(budget)
    reqs = random_requests(rng, window_model.vocab_size, 4)
    engine = engine_for(window_model, block_size=2, max_num_batched_tokens=budget)
    got = run(engine, reqs, [0, 1, 2, 3])
    assert got == alone(window_model, reqs)
    # and alone is the cache-free forward's greedy decoding (recompute at every token)
    for rid, prompt, sp in reqs[:2]:
        assert got[rid] == recomputed_greedy(window_model, prompt, sp.max_tokens)


@pytest.mark.parametrize("seed", range(2))
def test_qwen3_schedules_give_the_cache_free_greedy_tokens(tmp_path, tokenizer, seed):
    """Qwen3 (per-head q / k norms, head_dim apart from hidden / heads, tied embeddings):
    mixed steps through the native plan and prompt chunks through the modules give every
    request the greedy tokens of a recompute over its whole history."""
    from compress.runtime import LLM
    path, _ = save_model(tmp_path, "qwen3", tokenizer, tie_word_embeddings=True)
    model = LLM(path).model
    rng = random.Random(seed)
    reqs = random_requests(rng, model.vocab_size, 4)
    engine = engine_for(model, block_size=rng.choice([2, 16]), max_num_batched_tokens=rng.choice([3, 16]))
    assert engine.runner.native is not None
    got = run(engine, reqs, [0, 1, 1, 2])
    for rid, prompt, sp in reqs:
        assert got[rid] == recomputed_greedy(model, prompt, sp.max_tokens)


def test_seeded_sampling_does_not_depend_on_batch_mates(llm):
    rng = random.Random(3)
    reqs = random_requests(rng, llm.model.vocab_size, 5, greedy=False)
    reqs.append(("unseeded", [5, 6, 7], SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)))
    seeded = [r for r in reqs if r[2].seed is not None]
    engine = engine_for(llm.model, block_size=4, max_num_batched_tokens=8)
    got = run(engine, reqs, [0, 2, 0, 1, 3, 0])
    want = alone(llm.model, seeded)
    assert {rid: got[rid] for rid, _, _ in seeded} == want
    assert len({tuple(t) for t in want.values()}) > 1


@pytest.mark.parametrize("kv", [None, "int8"], ids=["kv_model", "kv_int8"])
def test_prefix_cache_hits_skip_compute_and_give_the_same_logprobs(llm, kv):
    model = llm.model
    prompt = list(range(10, 51))            # 41 tokens: 10 full blocks of 4 before the last token
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    engine = engine_for(model, block_size=4, kv_cache_dtype=kv)
    first = run(engine, [("a", prompt, params)], [0])
    prefilled = engine.stats()["tokens_prefilled"]
    engine.add_request("b", prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    (second,) = outs
    stats = engine.stats()
    assert second.token_ids == first["a"]
    assert stats["prefix_cache_hits"] == 40 and stats["tokens_prefilled"] - prefilled == 1
    assert second.metrics["cached_tokens"] == 40
    miss = engine_for(model, block_size=4, enable_prefix_caching=False, kv_cache_dtype=kv)
    miss.add_request("c", prompt, params)
    want = []
    while miss.has_unfinished():
        want += [o for o in miss.step() if o.finished]
    for hit, cold in zip(second.logprobs, want[0].logprobs):
        assert hit.token_id == cold.token_id and list(hit.top) == list(cold.top)
        assert hit.logprob == pytest.approx(cold.logprob, abs=1e-5)
        assert max(hit.top.values()) == pytest.approx(hit.logprob, abs=1e-6)   # greedy: the top-1


def test_abort_frees_blocks_at_once(llm):
    engine = engine_for(llm.model, block_size=4, enable_prefix_caching=True)
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=50, temperature=0.0))
    engine.add_request("b", list(range(3, 12)), SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    assert engine.abort("a") and not engine.abort("a") and not engine.abort("never")
    assert engine.stats()["kv_blocks_used"] == 3   # b: 9 + 2 tokens in blocks of 4
    assert engine.abort("b")
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished()
    engine.add_request("a", [5, 6], SamplingParams(max_tokens=1))   # the id is free again
    assert engine.step()[0].finished


def test_step_outputs_and_metrics(llm):
    engine = LLMEngine(llm.model, llm.tokenizer, llm.eos_token_ids, llm.bos_token_id, block_size=4)
    engine.add_request("t", "The quick brown fox", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                                   logprobs=2), arrival_time=1.0)
    seen = []
    while engine.has_unfinished():
        seen += engine.step()
    assert [len(o.token_ids) for o in seen] == [1, 2, 3, 4, 5]
    assert [o.finished for o in seen] == [False] * 4 + [True] and seen[-1].finish_reason == "length"
    last = seen[-1]
    assert last.request_id == "t" and last.prompt == "The quick brown fox" and last.text
    assert [lp.token_id for lp in last.logprobs] == last.token_ids
    assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in last.logprobs)
    m = last.metrics
    assert m["arrival_time"] == 1.0 and m["first_token_time"] <= m["finish_time"]
    assert m["decode_steps"] == 4 and m["prompt_tokens"] == len(last.prompt_token_ids)


def test_request_errors_name_the_problem(llm):
    engine = engine_for(llm.model, kv_cache_tokens=64)
    engine.add_request("x", [5, 6], SamplingParams())
    with pytest.raises(ValueError, match="request id 'x' is already in the engine"):
        engine.add_request("x", [5, 6], SamplingParams())
    with pytest.raises(ValueError, match="leaves no room to generate"):
        engine.add_request("y", [5] * llm.max_seq_len, SamplingParams())
    with pytest.raises(ValueError, match="does not fit the KV cache of 64 positions"):
        engine.add_request("y", [5] * 65, SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("y", [5, 10 ** 6], SamplingParams())
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("y", "text", SamplingParams())
    no_bos = LLMEngine(llm.model, None, (), None)
    with pytest.raises(ValueError, match="empty prompt and the model has no BOS token"):
        no_bos.add_request("y", [], SamplingParams())
    assert engine_for(llm.model).prompt_ids([]) == (None, [0])   # BOS in its place
