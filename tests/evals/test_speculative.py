"""eval.speculative: stages of a recipe measured as speculative drafts of the base --
its settings checked when the recipe is read (and by ``compress run --dry-run``), its
section of report.md, and one tiny recipe end to end (an RTN copy of the base drafting
for the base: nearly every draft token accepted, outputs identical)."""
import json

import pytest
import yaml

from compress.cli import main
from compress.config import ConfigError
from compress.recipe import load_recipe
from evals.eval_config import EvalConfig, check_eval_against_context
from evals.report import render_markdown


def _recipe(tmp_path, model_dir, speculative, **eval_extra):
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({
        "name": "spec", "model": {"path": str(model_dir)},
        "stages": [{"name": "int8", "steps": [{"method": "rtn", "bits": 8}]},
                   {"name": "int4", "steps": [{"method": "rtn", "bits": 4, "group_size": 32}]}],
        "eval": {"speculative": speculative, **eval_extra}}))
    return p


def test_drafts_are_stages_of_the_recipe(tmp_path, tiny_model_dir):
    spec = load_recipe(_recipe(tmp_path, tiny_model_dir, {"drafts": ["int4", "int8"], "k": 2})).eval.speculative
    assert (spec.drafts, spec.k, spec.new_tokens, spec.prompts, spec.prompt_len, spec.rounds) == (
        ["int4", "int8"], 2, 64, 4, 64, 3)
    assert EvalConfig().speculative is None                  # off unless asked
    for bad in ("int2", "base"):
        p = _recipe(tmp_path, tiny_model_dir, {"drafts": ["int4", bad]})
        with pytest.raises(ConfigError) as err:
            load_recipe(p)
        assert err.value.where == f"{p}: eval.speculative.drafts" and repr(bad) in err.value.message


@pytest.mark.parametrize("speculative, key", [
    ({"drafts": ["int4"], "k": 0}, "k"),
    ({"drafts": ["int4"], "k": "three"}, "k"),
    ({"drafts": []}, "drafts"),
    ({"drafts": ["int4"], "prompts": 0}, "prompts"),
    ({"drafts": ["int4"], "rounds": 0}, "rounds"),
    ({"drafts": ["int4"], "speed_up": 2}, "speed_up"),
])
def test_bad_settings_name_their_key(tmp_path, tiny_model_dir, speculative, key):
    p = _recipe(tmp_path, tiny_model_dir, speculative)
    with pytest.raises(ConfigError) as err:
        load_recipe(p)
    assert err.value.where == f"{p}: eval.speculative.{key}"


def test_dry_run_catches_a_bad_draft_and_a_window_the_context_cannot_take(tmp_path, tiny_model_dir, capsys):
    assert main(["run", str(_recipe(tmp_path, tiny_model_dir, {"drafts": ["int4", "int3"]})), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "r.yaml: eval.speculative.drafts: 'int3' names no stage of the recipe" in err and "Traceback" not in err
    # the tiny model's context is 128 tokens
    assert main(["run", str(_recipe(tmp_path, tiny_model_dir, {"drafts": ["int4"], "prompt_len": 100})),
                 "--dry-run"]) == 2
    assert "eval.speculative.prompt_len: prompt_len 100 + new_tokens 64 = 164 tokens" in capsys.readouterr().err
    assert main(["run", str(_recipe(tmp_path, tiny_model_dir, {"drafts": ["int4"], "file": "missing.txt"})),
                 "--dry-run"]) == 2
    assert "eval.speculative.file: evaluation text not found" in capsys.readouterr().err
    assert main(["run", str(_recipe(tmp_path, tiny_model_dir, {"drafts": ["int4"], "prompt_len": 32})),
                 "--dry-run"]) == 0
    check_eval_against_context(EvalConfig.from_dict({"speculative": {"drafts": ["x"]}}), None)


RECORDS = [
    {"name": "base", "path": "/ckpt/base", "perplexity": 12.5},
    {"name": "depth-int4", "path": "/ckpt/depth-int4", "perplexity": 20.0,
     "speculative": {"target": "base", "k": 3, "prompts": 4, "prompt_len": 64, "new_tokens": 64, "rounds": 3,
                     "alpha": 0.7123, "tokens_per_pass": 2.584, "target_tok_s": 310.0, "spec_tok_s": 276.2,
                     "speedup": 0.891, "identical": True}},
    {"name": "width-int4", "path": "/ckpt/width-int4", "perplexity": 21.0,
     "errors": {"speculative": {"message": "ValueError: draft broke", "traceback": "..."}}},
    {"name": "other", "path": "/ckpt/other", "perplexity": 13.0},
    {"name": "odd", "path": "/ckpt/odd",
     "speculative": {"k": 3, "alpha": 0.5, "tokens_per_pass": 1.9, "target_tok_s": 300.0, "spec_tok_s": 250.0,
                     "speedup": 0.83, "identical": False},
     "errors": {"speculative": {"message": "greedy outputs with the draft differ", "traceback": ""}}},
]


def test_the_section_of_the_report():
    md = render_markdown(RECORDS, machine={})
    section = md[md.index("## Speculative decoding (drafts of base)"):]
    assert "batch 1, greedy, 4 prompts of 64 tokens" in section and "3 rounds" in section
    assert ("| draft | k | α per token | tokens / verify | base alone tok/s | with draft tok/s | speedup | "
            "identical |") in section
    assert "| `depth-int4` | 3 | 0.712 | 2.58 | 310.0 | 276.2 | 0.89x | yes |" in section
    assert "| `width-int4` | error | error | error | error | error | error | error |" in section
    assert "| `odd` | 3 | 0.500 | 1.90 | 300.0 | 250.0 | 0.83x | error |" in section
    assert "`other`" not in section.split("## Errors")[0]
    assert "- `width-int4` speculative: ValueError: draft broke" in section      # listed under Errors
    assert "## Speculative" not in render_markdown(RECORDS[:1] + RECORDS[3:4], machine={})


@pytest.mark.slow
def test_an_rtn_copy_of_the_base_drafts_for_it(tmp_path, tiny_model_dir, tiny_text):
    """End to end through ``run_recipe``: the figures land in the draft's record, report.json
    and report.md; an int8 copy of the base agrees with it on nearly every greedy token."""
    from compress.pipeline import run_recipe

    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({
        "name": "spec", "model": {"path": str(tiny_model_dir)},
        "stages": [{"name": "int8", "steps": [{"method": "rtn", "bits": 8}]}],
        "export": {"output": "out"},
        "eval": {"perplexity": None, "kl": None, "speed": None,
                 "speculative": {"drafts": ["int8"], "k": 3, "new_tokens": 24, "prompts": 2, "prompt_len": 16,
                                 "rounds": 2, "file": str(tiny_text)}}}))
    result = run_recipe(load_recipe(p), tmp_path / "out", progress=False, log=lambda *_: None)
    assert result["failed_cells"] == []
    base, draft = result["stages"]
    assert "speculative" not in base
    spec = draft["speculative"]
    assert spec["identical"] is True and spec["alpha"] > 0.9, spec
    assert 3.0 < spec["tokens_per_pass"] <= 4.0 and spec["prompts"] == 2 and spec["new_tokens"] == 24 and spec["target_tok_s"] > 0 and spec["spec_tok_s"] > 0
    assert spec["speedup"] > 0 and len(spec["spec_tok_s_rounds"]) == 2 and sum(spec["accepted_hist"]) == spec[
        "spec_rows"]
    saved = json.loads((tmp_path / "out" / "report.json").read_text())["stages"]
    assert saved[1]["speculative"]["alpha"] == spec["alpha"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Speculative decoding (drafts of base)" in md and "| `int8` | 3 | " in md
