"""Fixtures of the eval tests (the tiny models are made by eval_models.py)."""

from __future__ import annotations

import os

import pytest

from eval_models import SAMPLE, make_model_dir

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "eval.txt"
    p.write_text((SAMPLE + "\n\n\n") * 6, encoding="utf-8")
    return p


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from evals.backend import load_llm
    return load_llm(tiny_model_dir)
