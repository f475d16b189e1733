import math

import pytest
import torch

from evals.perplexity import perplexity, rolling_windows


@pytest.mark.parametrize("n,seq_len,stride", [(10, 4, 2), (10, 4, 4), (7, 8, 3), (100, 16, 5),
                                              (2, 2, 1), (33, 8, 8), (1, 4, 2)])
def test_rolling_windows_score_every_token_once(n, seq_len, stride):
    scored = []
    for begin, end, k in rolling_windows(n, seq_len, stride):
        assert 0 <= begin < end <= n and end - begin <= seq_len and 1 <= k <= end - begin - (begin == 0)
        scored += list(range(end - k, end))
    assert scored == list(range(1, n))


def test_rolling_windows_rejects_bad_stride():
    with pytest.raises(ValueError):
        rolling_windows(10, 4, 5)
    with pytest.raises(ValueError):
        rolling_windows(10, 4, 0)


def _manual_nll(llm, ids):
    lp = torch.log_softmax(llm.logits(ids[None]).float(), -1)[0, :-1]
    return -float(lp.gather(-1, ids[1:, None]).sum())


def test_single_window_matches_manual(tiny_llm, tiny_text):
    ids = torch.tensor(tiny_llm.tokenizer(tiny_text.read_text(), verbose=False).input_ids)[:60]
    r = perplexity(tiny_llm, tiny_text, seq_len=64, stride=64, max_tokens=60, progress=False)
    assert r.tokens == 59
    assert r.nll == pytest.approx(_manual_nll(tiny_llm, ids), rel=1e-5)
    assert r.perplexity == pytest.approx(math.exp(r.nll / r.tokens))


def test_sliding_windows_deterministic_and_batch_invariant(tiny_llm, tiny_text):
    a = perplexity(tiny_llm, tiny_text, seq_len=32, stride=16, max_tokens=150, batch_size=4,
                   progress=False)
    b = perplexity(tiny_llm, tiny_text, seq_len=32, stride=16, max_tokens=150, batch_size=1,
                   progress=False)
    assert a.tokens == b.tokens == 149
    assert a.nll == pytest.approx(b.nll, rel=1e-5)
    # disjoint windows of the same stream: the same number of tokens, different contexts
    c = perplexity(tiny_llm, tiny_text, seq_len=32, stride=32, max_tokens=150, progress=False)
    assert c.tokens == 149 and c.nll != pytest.approx(a.nll, rel=1e-9)


def test_text_argument_and_errors(tiny_llm, tmp_path):
    r = perplexity(tiny_llm, text="Return the absolute value.", seq_len=16, stride=8, progress=False)
    assert r.tokens > 0 and r.perplexity > 1
    with pytest.raises(FileNotFoundError):
        perplexity(tiny_llm, tmp_path / "missing.txt", progress=False)
    with pytest.raises(ValueError):
        perplexity(tiny_llm, text="", progress=False)
