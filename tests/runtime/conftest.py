"""Fixtures for the runtime tests (the tiny models come from ``runtime_models``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from runtime_models import make_tokenizer, save_model  # noqa: E402


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Tiny models (see tests/conftest.py::one_thread)."""


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, tokenizer):
    path, _ = save_model(tmp_path_factory.mktemp("llama"), "llama", tokenizer)
    return path


@pytest.fixture(scope="session")
def llm(llama_dir):
    from compress.runtime import LLM
    return LLM(llama_dir)


@pytest.fixture(scope="session")
def embedded(repo_root):
    """The embedded model as ``load_model_for_compression`` gives it (the tests that
    quantize it work on a copy)."""
    from compress.model_loading import load_model_for_compression
    return load_model_for_compression(str(repo_root / "models" / "pydoc-llama"))
