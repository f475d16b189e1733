"""compress/training_data.py: the training section's files as deterministic token windows."""
import json

import pytest
import torch

from compress.training_data import TrainingDataError, load_training_data
from tiny_models import corpus_text, make_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def documents() -> list[str]:
    return [d for d in corpus_text().split("\n\n") if d.strip()]


@pytest.fixture
def corpus(tmp_path):
    """A text file and a jsonl file of the builtins' docstrings."""
    docs = documents()
    (tmp_path / "a.txt").write_text("\n\n".join(docs[:20]))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(docs[20:60])))
    return tmp_path


def expected_stream(tokenizer, texts):
    ids = []
    for t in texts:
        ids += tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids)


def test_windows_are_the_documents_in_order(tokenizer, corpus):
    docs = documents()
    stream = expected_stream(tokenizer, ["\n\n".join(docs[:20])] + docs[20:60])
    data = load_training_data([str(corpus / "a.txt"), str(corpus / "b.jsonl")], tokenizer,
                              tokens=stream.numel(), seq_len=64, seed=0, field="body")
    n = stream.numel() // 64
    assert data.windows.shape == (n, 64) and data.steps == n
    assert torch.equal(data.windows.flatten(), stream[:n * 64])


def test_batches_cover_the_budget_in_a_seeded_order(tokenizer, corpus):
    files = [str(corpus / "a.txt")]
    data = load_training_data(files, tokenizer, tokens=640, seq_len=32, seed=1)
    assert data.windows.shape == (20, 32)           # read only as far as the budget needs
    batches = list(data.batches(6))
    assert [b.shape[0] for b in batches] == [6, 6, 6, 2]
    seen = torch.cat(batches)
    assert sorted(seen.tolist()) == sorted(data.windows.tolist())      # every window once
    assert not torch.equal(seen, data.windows)                          # shuffled
    again = load_training_data(files, tokenizer, tokens=640, seq_len=32, seed=1)
    assert torch.equal(torch.cat(list(again.batches(6))), seen)
    other = load_training_data(files, tokenizer, tokens=640, seq_len=32, seed=2)
    assert not torch.equal(torch.cat(list(other.batches(6))), seen)


def test_short_data_repeats_in_new_orders(tokenizer, tmp_path):
    (tmp_path / "short.txt").write_text(corpus_text()[:600])
    data = load_training_data([str(tmp_path / "short.txt")], tokenizer, tokens=10_000, seq_len=16, seed=0)
    n = data.windows.shape[0]
    assert 2 < n < 10_000 // 16
    order = data.order()
    assert order.numel() == 10_000 // 16
    assert torch.equal(order[:n].sort().values, torch.arange(n))        # each pass is a permutation
    assert torch.equal(order[n:2 * n].sort().values, torch.arange(n))
    assert not torch.equal(order[:n], order[n:2 * n])


@pytest.mark.parametrize("setup, kwargs, message", [
    (None, {"files": ["missing.txt"]}, "training file not found: .*missing.txt"),
    ("", {"files": ["empty.txt"]}, r"the training set is empty \(.*empty.txt\)"),
    ('{"text": "x"}\nnot json\n', {"files": ["bad.jsonl"]}, r"training data: .*bad.jsonl:2: invalid JSON"),
    ('{"body": "x"}\n', {"files": ["bad.jsonl"]}, r"bad.jsonl:1: record has no field 'text'"),
    ("a few words", {"files": ["tiny.txt"]}, r"has \d+ tokens, fewer than one window of seq_len=64"),
    (None, {"files": []}, r"empty \(no files and no dataset\)"),
])
def test_missing_or_empty_data_is_named(tokenizer, tmp_path, setup, kwargs, message):
    files = [str(tmp_path / f) for f in kwargs["files"]]
    if setup is not None:
        (tmp_path / kwargs["files"][0]).write_text(setup)
    with pytest.raises(TrainingDataError, match=message):
        load_training_data(files, tokenizer, tokens=256, seq_len=64, seed=0)


def test_bad_sizes_are_refused(tokenizer, corpus):
    with pytest.raises(TrainingDataError, match="tokens >= seq_len"):
        load_training_data([str(corpus / "a.txt")], tokenizer, tokens=10, seq_len=64, seed=0)
    data = load_training_data([str(corpus / "a.txt")], tokenizer, tokens=256, seq_len=64, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        next(data.batches(0))
