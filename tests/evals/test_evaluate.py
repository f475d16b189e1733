import json
import math

import pytest

from evals.backend import load_llm
from evals.eval_config import EvalConfig
from evals.evaluate import evaluate_checkpoint
from evals.report import write_report
from evals.speed import measure_speed

from eval_models import make_model_dir


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


def test_short_context_model_evaluates_with_defaults(tiny_model_dir, tiny_text):
    """The tiny model's context is 128 tokens: every default is sized to it."""
    cfg = {"perplexity": {"file": str(tiny_text), "max_tokens": 400}, "kl": {"file": str(tiny_text)},
           "speed": {"repeats": 1, "warmup": 0}, "threads": 1, "progress": False}
    rec = evaluate_checkpoint(tiny_model_dir, cfg, {}, name="base")
    assert "errors" not in rec
    assert rec["context"] == 128 and rec["perplexity_tokens"] == 399 and rec["kl_tokens"] % 128 == 0
    assert rec["speed"]["prompt_len"] + rec["speed"]["new_tokens"] <= 128 and rec["decode_tok_s"] > 0
    assert rec["eval_settings"]["perplexity"]["stride"] == 64


def test_a_failing_cell_is_recorded_and_the_others_are_measured(tiny_model_dir, tiny_text, tmp_path,
                                                               monkeypatch):
    import evals.harness

    real_run_lm_eval = evals.harness.run_lm_eval

    def run_lm_eval(path, tasks, **kw):  # an unknown name costs lm-eval a minute of indexing
        if "no_such_task" in tasks:
            raise KeyError("Spec 'no_such_task' is not a registered task/group/tag name")
        return real_run_lm_eval(path, tasks, **kw)

    monkeypatch.setattr(evals.harness, "run_lm_eval", run_lm_eval)
    stage_dir = make_model_dir(tmp_path / "stage", noise=0.02)
    cfg = {"perplexity": {"file": str(tiny_text), "seq_len": 32, "max_tokens": 200},
           "kl": {"file": str(tmp_path / "missing.txt"), "seq_len": 32},
           "speed": {"prompt_len": 128, "repeats": 1, "warmup": 0},   # leaves no room to generate
           "tasks": ["pydoc_cloze", "no_such_task"], "task_limit": 4, "threads": 1, "progress": False}
    cache = {}
    base = evaluate_checkpoint(tiny_model_dir, cfg, cache, name="base")
    stage = evaluate_checkpoint(stage_dir, cfg, cache, name="noisy")
    for rec in (base, stage):
        assert rec["perplexity"] > 1 and 0 <= rec["tasks"]["pydoc_cloze"]["acc"] <= 1
        assert set(rec["errors"]) == {"kl", "speed", "tasks.no_such_task"}
        assert "prompt_len" in rec["errors"]["speed"]["message"]
        assert "Traceback" in rec["errors"]["speed"]["traceback"]
        assert rec.get("kl_to_base") is None and rec.get("decode_tok_s") is None
    assert "missing.txt" in base["errors"]["kl"]["message"]
    # the stage is not its own KL reference when the base's failed
    assert "the base's failed" in stage["errors"]["kl"]["message"]
    j, m = write_report([base, stage], tmp_path / "report")
    md = m.read_text()
    assert "| `noisy` | " in md and "| error | error |" in md and "## Errors" in md
    assert "| no_such_task | — | error | error |" in md
    assert "- `base` speed: ConfigError: eval.speed.prompt_len: 128 leaves no room to generate" in md
    saved = json.loads(j.read_text())["stages"][1]["errors"]
    assert set(saved) == {"kl", "speed", "tasks.no_such_task"}


def test_a_checkpoint_that_does_not_load_still_gets_a_record(tmp_path, tiny_text):
    rec = evaluate_checkpoint(tmp_path, {"perplexity": {"file": str(tiny_text)}, "progress": False},
                              name="base")
    assert {"size", "load"} <= set(rec["errors"]) and rec.get("perplexity") is None
    j, m = write_report([rec], tmp_path / "report")
    assert "| `base` | error | error | error |" in m.read_text()
