"""The default training text: regenerated from the installed standard library, cached,
and sharing no document with the shipped calibration and evaluation files."""
from distill import default_text


def test_default_training_text_shares_no_document_with_eval_or_calib(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))
    path = default_text.default_training_file()
    assert path.parent == tmp_path and path.stat().st_size > 100_000
    corpus = default_text._corpus_module()
    train = set(corpus.read_docs(path))
    for shipped in default_text.HELD_OUT_FILES:
        held = set(corpus.read_docs(shipped))
        assert held and not train & held, f"{shipped.name} shares {len(train & held)} documents with the training text"
    mtime = path.stat().st_mtime_ns
    assert default_text.default_training_file() == path and path.stat().st_mtime_ns == mtime   # cached
