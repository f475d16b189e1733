import math

import pytest

from evals.backend import load_llm
from evals.evaluate import EvalConfig, evaluate_checkpoint
from evals.report import write_report
from evals.speed import measure_speed

from conftest import make_model_dir


def _cfg(text):
    return {"perplexity": {"file": str(text), "seq_len": 32, "stride": 16, "max_tokens": 200},
            "kl": {"file": str(text), "windows": 2, "seq_len": 32},
            "tasks": ["pydoc_cloze"], "task_limit": 4, "threads": 1,
            "speed": {"prompt_len": 16, "new_tokens": 4, "repeats": 1, "warmup": 0},
            "progress": False}


def test_evaluate_base_then_stage_and_report(tiny_model_dir, tiny_text, tmp_path):
    stage_dir = make_model_dir(tmp_path / "stage", noise=0.02)
    cache = {}
    base = evaluate_checkpoint(tiny_model_dir, _cfg(tiny_text), cache, name="base")
    assert "reference" in cache and base["kl_to_base"] == 0.0 and base["top1_agreement"] == 1.0
    stage = evaluate_checkpoint(stage_dir, _cfg(tiny_text), cache, name="noisy")
    for rec in (base, stage):
        assert rec["perplexity"] > 1 and rec["perplexity_tokens"] == 199
        assert 0 <= rec["tasks"]["pydoc_cloze"]["acc"] <= 1
        assert rec["prefill_tok_s"] > 0 and rec["decode_tok_s"] > 0
        assert rec["size_bytes"] > 0 and rec["bits_per_weight"] == 32.0
    assert stage["kl_to_base"] > 0 and stage["perplexity"] != base["perplexity"]
    again = evaluate_checkpoint(stage_dir, {**_cfg(tiny_text), "speed": None, "tasks": []},
                                cache["reference"])
    assert again["perplexity"] == stage["perplexity"] and again["kl_to_base"] == stage["kl_to_base"]
    j, m = write_report([base, stage], tmp_path / "report")
    assert "noisy" in m.read_text()


def test_eval_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="bogus"):
        EvalConfig.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="eval.kl"):
        EvalConfig.from_dict({"kl": {"windowz": 3}})
    cfg = EvalConfig.from_dict({"speed": False, "kl": None})
    assert cfg.speed is None and cfg.kl is None and cfg.perplexity is not None


@pytest.mark.parametrize("kernels", ["native", "transformers"])
def test_measure_speed(tiny_model_dir, kernels):
    llm = load_llm(tiny_model_dir, kernels=kernels)
    s = measure_speed(llm, prompt_len=16, new_tokens=5, repeats=2, warmup=1)
    assert s.prompt_len == 16 and s.new_tokens == 5
    assert s.prefill_tok_s > 0 and s.decode_tok_s > 0 and not math.isnan(s.decode_tok_s)
