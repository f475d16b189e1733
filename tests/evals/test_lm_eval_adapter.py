import importlib.util

import pytest
import torch
from lm_eval.api.instance import Instance

from evals.lm_eval_adapter import CompressLM


@pytest.fixture(scope="module")
def lm(tiny_model_dir, tiny_llm):
    return CompressLM(pretrained=str(tiny_model_dir), batch_size=3, llm=tiny_llm)


def _req(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def _manual(llm, ctx_ids, cont_ids):
    ids = torch.tensor([ctx_ids + cont_ids])
    lp = torch.log_softmax(llm.logits(ids).float(), -1)[0, :-1]
    return float(lp[-len(cont_ids):].gather(-1, torch.tensor(cont_ids)[:, None]).sum())


def test_registered_and_arg_string(tiny_model_dir):
    from lm_eval.api.registry import get_model
    assert get_model("compress") is CompressLM
    lm = CompressLM.create_from_arg_string(
        f"pretrained={tiny_model_dir},dtype=float32,kernels=native,batch_size=2",
        {"batch_size": None, "device": "cpu", "max_batch_size": None})
    assert lm.batch_size == 2 and lm.max_length == 128


def test_loglikelihood_token_boundaries(lm, tiny_llm):
    tok = tiny_llm.tokenizer
    ctx, cont = "Return the absolute", " value"
    (got, greedy), = lm.loglikelihood([_req("loglikelihood", ctx, cont)], disable_tqdm=True)
    whole = tok(ctx + cont).input_ids
    n_ctx = len(tok(ctx).input_ids)
    assert whole[0] == tok.bos_token_id
    assert got == pytest.approx(_manual(tiny_llm, whole[:n_ctx], whole[n_ctx:]), abs=1e-4)
    assert isinstance(greedy, bool)
    # a trailing space of the context moves to the continuation
    (moved, _), = lm.loglikelihood([_req("loglikelihood", ctx + " ", "value")], disable_tqdm=True)
    assert moved == pytest.approx(got, abs=1e-5)


def test_empty_context_uses_bos_prefix(lm, tiny_llm):
    tok = tiny_llm.tokenizer
    (got, _), = lm.loglikelihood([_req("loglikelihood", "", "Open file")], disable_tqdm=True)
    cont = tok("Open file", add_special_tokens=False).input_ids
    assert got == pytest.approx(_manual(tiny_llm, [tok.bos_token_id], cont), abs=1e-4)


def test_batching_and_order_do_not_change_scores(lm, tiny_model_dir, tiny_llm):
    reqs = [_req("loglikelihood", c, x) for c, x in
            [("Return", " a new list"), ("Open file and", " return"), ("A", " set"), ("The file", " is")]]
    a = lm.loglikelihood(reqs, disable_tqdm=True)
    one = CompressLM(pretrained=str(tiny_model_dir), batch_size=1, llm=tiny_llm)
    b = one.loglikelihood(reqs[::-1], disable_tqdm=True)[::-1]
    for (x, gx), (y, gy) in zip(a, b):
        assert x == pytest.approx(y, abs=1e-4) and gx == gy


def test_rolling_scores_every_token_once(lm, tiny_llm, tiny_text):
    text = tiny_text.read_text()[:1500]          # longer than the 128-token context
    (got,) = lm.loglikelihood_rolling([_req("loglikelihood_rolling", text)], disable_tqdm=True)
    ids = tiny_llm.tokenizer(text).input_ids     # BOS + text; lm-eval prefixes another BOS
    assert len(ids) > 128
    from evals.perplexity import stream_nll
    nll, n = stream_nll(tiny_llm, torch.tensor([tiny_llm.tokenizer.bos_token_id] + ids),
                        seq_len=128, stride=128, progress=False)
    assert n == len(ids)
    assert got == pytest.approx(-nll, rel=0.05)  # same tokens; contexts differ at window edges


def test_generate_until_stops_and_is_greedy(lm, tiny_llm):
    reqs = [_req("generate_until", "Return the", {"until": ["\n"], "max_gen_toks": 8}),
            _req("generate_until", "Open", {"until": ["e"], "max_gen_toks": 8, "do_sample": False})]
    a = lm.generate_until(reqs, disable_tqdm=True)
    assert len(a) == 2 and all(isinstance(s, str) for s in a)
    assert "\n" not in a[0] and "e" not in a[1]
    assert lm.generate_until(reqs, disable_tqdm=True) == a
    ids = tiny_llm.tokenizer("Return the").input_ids
    for _ in range(8):
        nxt = int(tiny_llm.logits(torch.tensor([ids]))[0, -1].argmax())
        ids.append(nxt)
        if nxt == tiny_llm.tokenizer.eos_token_id:
            break
    full = tiny_llm.tokenizer.decode(ids[len(tiny_llm.tokenizer("Return the").input_ids):],
                                     skip_special_tokens=True)
    assert full.split("\n")[0] == a[0]


@pytest.mark.slow
def test_scores_match_lm_eval_hf_model(tiny_model_dir):
    """``--model compress`` and ``--model hf`` agree on an unquantized checkpoint."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("lm-eval's hf model needs the 'accelerate' package")
    from evals.harness import run_lm_eval
    tasks = ["pydoc_ppl", "pydoc_cloze"]
    ours = run_lm_eval(tiny_model_dir, tasks, limit=12, batch_size=4)
    ref = run_lm_eval(tiny_model_dir, tasks, limit=12, batch_size=4, model="hf")
    assert ours["pydoc_cloze"]["acc"] == pytest.approx(ref["pydoc_cloze"]["acc"], abs=1e-6)
    assert ours["pydoc_cloze"]["acc_norm"] == pytest.approx(ref["pydoc_cloze"]["acc_norm"], abs=1e-6)
    for m in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert ours["pydoc_ppl"][m] == pytest.approx(ref["pydoc_ppl"][m], rel=1e-3)


def _manual_read(llm, ctx_ids, cont_ids):
    """Like ``_manual``, with the model reading (context + continuation)[:-1] only."""
    ids = torch.tensor([(ctx_ids + cont_ids)[:-1]])
    lp = torch.log_softmax(llm.logits(ids).float(), -1)[0]
    return float(lp[-len(cont_ids):].gather(-1, torch.tensor(cont_ids)[:, None]).sum())


def _long_ids(tok, n):
    ids = tok("Return the absolute value of the argument. " * 80, add_special_tokens=False,
              verbose=False).input_ids
    assert len(ids) >= n
    return ids[:n]


def test_over_long_context_is_cut_from_the_left(lm, tiny_llm):
    ctx, cont = _long_ids(tiny_llm.tokenizer, 300), [5, 6, 7]
    (got, _), = lm._loglikelihood_tokens([(None, ctx, cont)], disable_tqdm=True)
    kept = (ctx + cont)[-129:]                       # 128 positions read, predicting the last 3
    assert got == pytest.approx(_manual_read(tiny_llm, kept[:-3], cont), abs=1e-4)


def test_over_long_continuation_scores_its_last_tokens_with_one_warning(lm, tiny_llm, caplog):
    tok = tiny_llm.tokenizer
    cont = _long_ids(tok, 200)
    reqs = [(None, [tok.bos_token_id], cont), (None, [tok.bos_token_id], cont[:50]),
            (None, [tok.bos_token_id, 7], cont[10:])]
    with caplog.at_level("WARNING", logger="evals.lm_eval_adapter"):
        scores = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    warnings = [r for r in caplog.records if "longer than the model's context" in r.getMessage()]
    assert len(warnings) == 1 and "2 of 3 requests" in warnings[0].getMessage()
    whole = [tok.bos_token_id] + cont
    assert scores[0][0] == pytest.approx(_manual_read(tiny_llm, whole[-129:-128], whole[-128:]), abs=1e-4)
    assert scores[1][0] == pytest.approx(_manual(tiny_llm, [tok.bos_token_id], cont[:50]), abs=1e-4)
    # through lm-eval's own entry point (text requests), no assertion either
    text = tok.decode(cont)
    (got, greedy), = lm.loglikelihood([_req("loglikelihood", "Return", " " + text)], disable_tqdm=True)
    assert got < 0 and isinstance(greedy, bool)


def test_empty_continuation_scores_zero(lm):
    assert lm._loglikelihood_tokens([(None, [1, 5], []), (None, [1], [5])], disable_tqdm=True)[0] == (0.0, True)


def test_generation_longer_than_the_context_is_shortened(lm, caplog):
    reqs = [_req("generate_until", "Return the", {"until": ["\n\n\n"], "max_gen_toks": 500})]
    with caplog.at_level("WARNING", logger="evals.lm_eval_adapter"):
        (text,) = lm.generate_until(reqs, disable_tqdm=True)
    assert isinstance(text, str)
    assert any("1 of 1 requests" in r.getMessage() for r in caplog.records)


def test_tokenizing_a_long_document_warns_nothing(tiny_model_dir, tiny_llm):
    """lm-eval's documents and our eval files are longer than the model's context on purpose."""
    import logging

    from transformers import AutoTokenizer

    from evals.backend import encode

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, model_max_length=16)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers.tokenization_utils_base")
    logger.addHandler(handler)
    try:
        lm = CompressLM(pretrained=str(tiny_model_dir), llm=tiny_llm)
        lm.tokenizer = tok
        text = "Return the absolute value of the argument. " * 20
        assert len(lm.tok_encode(text)) > 16
        assert len(encode(type("FakeLLM", (), {"tokenizer": tok})(), text)) > 16
        assert tok.encode(text) and records         # the warning this guards against
    finally:
        logger.removeHandler(handler)
    assert len(records) == 1
