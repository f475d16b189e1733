"""Seeded workloads of `compress bench serve`: exact lengths, same seed same requests,
shared prefixes, the long-prompt scenario and Poisson arrivals."""
import statistics

import pytest

from compress.bench.serve.workload import (DEFAULT_TEXT_FILES, WorkloadError, WorkloadSettings, build_workload,
                                           corpus_ids, local_encoder, long_prompt_workload, poisson_arrivals,
                                           random_workload, read_texts, shared_prefix_workload)

CORPUS = list(range(5000))   # distinct ids: a window's position is readable from its first id


def test_random_workload_lengths_and_seed():
    a = random_workload(CORPUS, 200, seed=3)
    assert a == random_workload(CORPUS, 200, seed=3)
    assert a != random_workload(CORPUS, 200, seed=4)
    assert all(32 <= len(r.prompt) <= 512 and 16 <= r.max_tokens <= 128 for r in a)
    # the ranges are used, not one corner of them
    assert min(len(r.prompt) for r in a) < 80 and max(len(r.prompt) for r in a) > 460
    assert min(r.max_tokens for r in a) < 30 and max(r.max_tokens for r in a) > 115
    # each prompt is a contiguous window of the corpus
    assert all(list(r.prompt) == CORPUS[r.prompt[0]:r.prompt[0] + len(r.prompt)] for r in a)
    assert len({r.prompt[0] for r in a}) > 150, "windows start at different places"


def test_fixed_lengths():
    s = WorkloadSettings(prompt_len=(100, 100), output_len=(7, 7))
    assert {(len(r.prompt), r.max_tokens) for r in random_workload(CORPUS, 10, 0, s)} == {(100, 7)}


def test_shared_prefix_workload():
    s = WorkloadSettings(prefix_len=300, suffix_len=(10, 20))
    reqs = shared_prefix_workload(CORPUS, 20, seed=1, settings=s)
    prefix = reqs[0].prompt[:300]
    assert all(r.prompt[:300] == prefix and 310 <= len(r.prompt) <= 320 for r in reqs)
    assert len({r.prompt[300:] for r in reqs}) == 20
    assert reqs == shared_prefix_workload(CORPUS, 20, seed=1, settings=s)


def test_long_prompt_workload():
    s = WorkloadSettings(running=5, running_output_len=200, long_prompt_len=2000, long_output_len=8)
    reqs = long_prompt_workload(CORPUS, seed=2, settings=s)
    assert [r.role for r in reqs] == ["running"] * 5 + ["long"]
    assert all(r.max_tokens == 200 and 32 <= len(r.prompt) <= 128 for r in reqs[:5])
    assert len(reqs[-1].prompt) == 2000 and reqs[-1].max_tokens == 8
    assert build_workload("long-prompt", CORPUS, 99, 2, s) == reqs


def test_errors_name_the_setting():
    with pytest.raises(WorkloadError, match="only 100"):
        random_workload(list(range(100)), 1, 0, WorkloadSettings(prompt_len=(200, 300)))
    with pytest.raises(WorkloadError, match="output length"):
        random_workload(CORPUS, 1, 0, WorkloadSettings(output_len=(9, 3)))
    with pytest.raises(WorkloadError, match="workload 'nope'"):
        build_workload("nope", CORPUS, 1, 0)
    with pytest.raises(WorkloadError, match="rate"):
        poisson_arrivals(3, 0.0, 0)
    with pytest.raises(WorkloadError, match="does not exist"):
        read_texts(["/nonexistent/text.txt"])


def test_poisson_arrivals():
    t = poisson_arrivals(4000, rate=5.0, seed=0)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.06)
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.1)   # exponential: sd = mean
    assert t == poisson_arrivals(4000, 5.0, 0) and t != poisson_arrivals(4000, 5.0, 1)


def test_default_text_through_the_embedded_tokenizer(repo_root):
    encode = local_encoder(repo_root / "models" / "pydoc-llama")
    assert encode is not None and local_encoder(repo_root / "data") is None
    ids = corpus_ids(read_texts(DEFAULT_TEXT_FILES[:1]), encode)
    assert len(ids) > 20000 and all(isinstance(i, int) for i in ids[:10])
    reqs = random_workload(ids, 8, 0)
    assert all(32 <= len(r.prompt) <= 512 for r in reqs)
