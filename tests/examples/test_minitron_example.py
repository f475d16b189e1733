"""examples/minitron.yaml: it passes the dry-run checks as shipped, and a copy shrunk
through the recipe API (fewer calibration windows, training tokens and eval windows)
runs every stage end to end into one report with its plots."""
import dataclasses

import pytest

from compress.recipe import load_recipe

STAGES = ["pruned", "healed", "awq-int4", "llm-int8"]


@pytest.fixture
def example(repo_root):
    return load_recipe(repo_root / "examples" / "minitron.yaml")


def test_the_example_passes_the_dry_run_checks(example):
    from compress.preflight import preflight

    preflight(example)                      # raises on a shape or setting the model cannot take
    assert [s.name for s in example.stages] == STAGES
    assert [[st.method for st in s.steps] for s in example.stages] == [["prune"], ["distill"], ["awq"], ["llm_int8"]]
    assert [s.source for s in example.stages] == ["base", "pruned", "healed", "healed"]
    healed = example.stages[1].steps[0]
    assert healed.teacher.stage == "base"                 # KD from the unpruned model
    assert example.training is None                       # the default offline training text


def shrink(recipe):
    """The example with every budget cut to seconds of work (same stages and methods)."""
    recipe.calibration = dataclasses.replace(recipe.calibration, samples=8, seq_len=64)
    for stage in recipe.stages:
        for i, step in enumerate(stage.steps):
            if step.method == "distill":
                config = dataclasses.replace(step.config, tokens=8 * 4 * 64, seq_len=64, batch_size=4,
                                             held_out_windows=2, eval_every=0, checkpoint_every=4)
                stage.steps[i] = dataclasses.replace(step, config=config)
    ev = recipe.eval
    recipe.eval = dataclasses.replace(
        ev, perplexity=dataclasses.replace(ev.perplexity, seq_len=64, stride=64, max_tokens=2048),
        kl=dataclasses.replace(ev.kl, windows=4, seq_len=64), task_limit=8,
        speed=dataclasses.replace(ev.speed, prompt_len=16, new_tokens=8, repeats=1))
    return recipe


@pytest.mark.slow
def test_a_shrunken_copy_runs_every_stage_into_one_report(example, one_thread, tmp_path):
    from compress.pipeline import run_recipe

    result = run_recipe(shrink(example), tmp_path / "out", progress=False, log=lambda *_: None)
    assert result["failed_cells"] == []
    rec = {r["name"]: r for r in result["stages"]}
    assert list(rec) == ["base"] + STAGES
    base, pruned, healed = rec["base"], rec["pruned"], rec["healed"]
    assert 0.4 < pruned["parameters"] / base["parameters"] < 0.6                    # about half
    assert healed["parameters"] == rec["awq-int4"]["parameters"] == rec["llm-int8"]["parameters"] \
        == pruned["parameters"]
    assert rec["awq-int4"]["size_bytes"] < rec["llm-int8"]["size_bytes"] < healed["size_bytes"] < base["size_bytes"]
    assert healed["kl_to_base"] < pruned["kl_to_base"]                              # 8 steps of KD already heal
    md = (tmp_path / "out" / "report.md").read_text()
    for png in ("perplexity_vs_size.png", "decode_vs_size.png"):
        assert (tmp_path / "out" / png).read_bytes()[:4] == b"\x89PNG" and f"]({png})" in md
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()) == sorted(STAGES)  # no checkpoints left
