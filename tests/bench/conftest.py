"""Fixtures for the bench tests: a tiny benchmark model made by ``compress bench make-model``."""
from __future__ import annotations

import pytest

TINY_SHAPE = dict(hidden=128, layers=2, intermediate=256, heads=4, kv_heads=2, vocab=512, max_positions=256)


@pytest.fixture(scope="session")
def tiny_bench_shape() -> dict:
    """make_bench_model's shape arguments of the tiny model."""
    return dict(TINY_SHAPE)


@pytest.fixture(scope="session")
def tiny_bench_model(tmp_path_factory):
    """{"hf", "rtn-int4", "rtn-int8"} -> path of a tiny make-model output (no tokenizer)."""
    from compress.bench.make_model import make_bench_model

    return make_bench_model(tmp_path_factory.mktemp("bench-model") / "tiny", **TINY_SHAPE, tokenizer_from=None,
                            sentencepiece=False, log=lambda *_: None)
