"""Fixtures of the serve tests: the embedded model, its reference outputs computed before
any server runs (the engine is single-threaded: once a server's engine thread owns it,
nothing else may touch it), and a live server on 127.0.0.1 (a free port) per module."""
from __future__ import annotations

from pathlib import Path

import pytest

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "pydoc-llama"
MODEL_NAME = "pydoc-llama"
MAX_NUM_SEQS = 4


def client(server, **kw):
    """The openai client on ``server`` (no retries: a test sees the first answer)."""
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


@pytest.fixture(scope="session")
def embedded_llm():
    from compress.runtime import LLM

    return LLM(str(EMBEDDED), max_batch_size=MAX_NUM_SEQS)


@pytest.fixture(scope="session")
def direct_llm():
    """A second LLM on the embedded model, for the runtime's own outputs while a server
    runs on ``embedded_llm`` (whose generate / stream then refuse: LLMEngine.check_owner)."""
    from compress.runtime import LLM

    return LLM(str(EMBEDDED), max_batch_size=MAX_NUM_SEQS)


@pytest.fixture(scope="module")
def server(embedded_llm, references):
    """A running server over the embedded model; tests may change ``server.state.config``
    (restored after each test by ``fresh_config``)."""
    from compress.serve.server import ServerThread
    from compress.serve.state import ServeConfig

    with ServerThread(embedded_llm, ServeConfig(model_name=MODEL_NAME, max_num_seqs=MAX_NUM_SEQS,
                                                max_queue=8, request_timeout=60)) as srv:
        yield srv


@pytest.fixture(autouse=True)
def fresh_config(request):
    if "server" not in request.fixturenames:
        yield
        return
    srv = request.getfixturevalue("server")
    from dataclasses import replace

    saved = replace(srv.state.config)
    yield
    srv.state.config = saved


@pytest.fixture(scope="session")
def references(embedded_llm):
    """Greedy completions and prompt logprobs computed on the LLM directly (no server)."""
    from compress.runtime import SamplingParams

    prompts = ["Return the", "Create a new"]
    outs = embedded_llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    ids = embedded_llm.encode("Return the number of items")
    return {"prompts": prompts, "texts": [o.text for o in outs], "token_ids": [o.token_ids for o in outs],
            "score_ids": ids, "score_logprobs": embedded_llm.token_logprobs([ids])[0].tolist()}
