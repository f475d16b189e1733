"""Fixtures for the runtime tests (the tiny models come from ``runtime_models``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from runtime_models import make_tokenizer, save_model  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads; on a busy 2-core machine they thrash."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
