"""lm-eval's ``local-completions`` model against compress serve scores pydoc_cloze as
``--model compress`` does on the same model.

``local-completions`` tokenizes through the server (``/tokenize`` without special
tokens) and sends token ids; the server scores them with ``echo=true, logprobs=1``
(one cache-free forward of the prompt). The ``compress`` model scores the same token ids
when it too leaves BOS out (``add_bos_token=False``). Both take their log-softmax in fp32
from the runtime's logits, but of differently shaped batches (the server: one prompt per
forward; the adapter: right-padded batches of 8), so a row's logits may differ in the
last bits: accuracies are asserted equal, each choice's loglikelihood within 1e-4.
"""
from __future__ import annotations

import pytest

from conftest import EMBEDDED, MAX_NUM_SEQS, MODEL_NAME

LIMIT = 40


def _evaluate(model, model_args=None):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import evals.lm_eval_adapter  # noqa: F401  registers "compress"
    from evals.lm_eval_quiet import quiet_lm_eval
    from evals.tasks import task_dir

    with quiet_lm_eval():
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["pydoc_cloze"], limit=LIMIT,
                                       task_manager=TaskManager(include_path=str(task_dir()),
                                                                include_defaults=False),
                                       log_samples=True, random_seed=0, numpy_random_seed=0,
                                       torch_random_seed=0, fewshot_random_seed=0)


def _loglikelihoods(results) -> list[tuple[float, bool]]:
    samples = sorted(results["samples"]["pydoc_cloze"], key=lambda s: s["doc_id"])
    return [tuple(resp[0]) for s in samples for resp in s["resps"]]


@pytest.mark.slow
def test_local_completions_scores_equal_the_compress_model(embedded_llm):
    from evals.lm_eval_adapter import CompressLM
    from compress.serve.server import ServerThread
    from compress.serve.state import ServeConfig

    ours = _evaluate(CompressLM(pretrained=str(EMBEDDED), llm=embedded_llm, add_bos_token=False, batch_size=8))
    with ServerThread(embedded_llm, ServeConfig(model_name=MODEL_NAME, max_num_seqs=MAX_NUM_SEQS)) as srv:
        served = _evaluate("local-completions", f"base_url={srv.url}/v1/completions,model={MODEL_NAME},"
                                                f"max_length=1024,batch_size=4")
        tokenize_calls = srv.state.requests[("/tokenize", 200)]
    assert tokenize_calls > 0                         # lm-eval picked the remote tokenizer itself
    a, b = ours["results"]["pydoc_cloze"], served["results"]["pydoc_cloze"]
    assert a["acc,none"] == b["acc,none"] and a["acc_norm,none"] == b["acc_norm,none"]
    la, lb = _loglikelihoods(ours), _loglikelihoods(served)
    assert len(la) == len(lb) == 4 * LIMIT
    assert max(abs(x[0] - y[0]) for x, y in zip(la, lb)) < 1e-4
    assert [x[1] for x in la] == [y[1] for y in lb]
