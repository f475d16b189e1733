import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# the largest test writes ~1.7 GB under tmp_path (a 180M-parameter float32 model and its exports)
DISK_NEEDED = 3 * 2**30


def pytest_sessionstart(session):
    """Names the free space where tmp_path lives when it is short, first thing in the run:
    a full disk otherwise shows up as a wall of unrelated setup errors."""
    import shutil
    import tempfile

    config = session.config
    base = Path(config.option.basetemp or tempfile.gettempdir())
    while not base.exists():
        base = base.parent
    free = shutil.disk_usage(base).free
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if free < DISK_NEEDED and reporter is not None:
        reporter.write_line(f"WARNING: {free / 2**30:.1f} GiB free under {base}, less than the "
                            f"{DISK_NEEDED / 2**30:.0f} GiB the largest tests write: expect "
                            "'No space left on device' errors", yellow=True, bold=True)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session", params=["llama", "mistral", "qwen2", "qwen3"])
def tiny_family_dir(request, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture
def one_thread():
    """Many tiny ops gain nothing from threads; on a busy 2-core machine they thrash.
    Directories of such tests use it autouse from their conftest."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# the tiny model `compress bench make-model` writes for the bench tests (tests/bench)
TINY_BENCH_SHAPE = dict(hidden=128, layers=2, intermediate=256, heads=4, kv_heads=2, vocab=512, max_positions=256)


@pytest.fixture(scope="session")
def tiny_bench_shape() -> dict:
    """make_bench_model's shape arguments of ``tiny_bench_model``."""
    return dict(TINY_BENCH_SHAPE)


@pytest.fixture(scope="session")
def tiny_bench_model(tmp_path_factory) -> dict:
    """{"hf", "rtn-int4", "rtn-int8"} -> path: a tiny ``compress bench make-model`` output
    (no tokenizer)."""
    from compress.bench.make_model import make_bench_model

    return make_bench_model(tmp_path_factory.mktemp("bench-model") / "tiny", **TINY_BENCH_SHAPE,
                            tokenizer_from=None, sentencepiece=False, log=lambda *_: None)
