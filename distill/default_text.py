"""The default training text (a recipe without ``training:``): the pydoc corpus's
``train`` split regenerated from the installed standard library by
``data/pydoc/make_corpus.py``, without any document of the shipped calibration and
evaluation files (``data/pydoc/calib.txt``, ``eval.txt``): nothing trains on the eval
text. Works offline on a fresh machine; written once to the cache
(``$COMPRESS_CACHE`` or ``~/.cache/compress``), keyed by the stdlib, the script and the
shipped files."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS_SCRIPT = REPO / "data" / "pydoc" / "make_corpus.py"
HELD_OUT_FILES = (REPO / "data" / "pydoc" / "calib.txt", REPO / "data" / "pydoc" / "eval.txt")


def cache_dir() -> Path:
    return Path(os.environ.get("COMPRESS_CACHE") or Path.home() / ".cache" / "compress")


def _corpus_module():
    spec = importlib.util.spec_from_file_location("_compress_pydoc_corpus", CORPUS_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _key(corpus) -> str:
    h = hashlib.sha1()
    h.update(sys.version.encode())
    h.update(str(corpus.stdlib_root()).encode())
    for path in (CORPUS_SCRIPT, *HELD_OUT_FILES):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def training_documents(corpus=None) -> list[str]:
    """The train split's documents, less every document of the shipped calib/eval files."""
    corpus = corpus or _corpus_module()
    excluded = {d for path in HELD_OUT_FILES if path.is_file() for d in corpus.read_docs(path)}
    return [d for d in corpus.build_corpus()["train"] if d.strip() not in excluded]


def default_training_file() -> Path:
    """The cached default training text (built on first use, written atomically)."""
    if not CORPUS_SCRIPT.is_file():
        raise FileNotFoundError(f"the default training text needs {CORPUS_SCRIPT}; give the recipe a 'training:' "
                                "section instead")
    corpus = _corpus_module()
    path = cache_dir() / f"pydoc-train-{_key(corpus)}.txt"
    if not path.is_file():
        docs = training_documents(corpus)
        if not docs:
            raise FileNotFoundError(f"no training documents found in the standard library at {corpus.stdlib_root()}")
        corpus.write_split(docs, path)
    return path
