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
