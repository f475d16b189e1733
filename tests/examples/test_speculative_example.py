"""examples/speculative.yaml: it passes the dry-run checks as shipped (the drafts of issue
24: a depth-pruned and a width-pruned student of the embedded model, each healed by KD
from the base, then int4 with a group size that divides the pruned sizes)."""
from compress.recipe import load_recipe

STAGES = ["depth", "depth-kd", "depth-int4", "width", "width-kd", "width-int4"]


def test_the_example_passes_the_dry_run_checks(repo_root):
    from compress.preflight import preflight

    example = load_recipe(repo_root / "examples" / "speculative.yaml")
    preflight(example)                      # raises on a shape or setting the model cannot take
    assert [s.name for s in example.stages] == STAGES
    assert [[st.method for st in s.steps] for s in example.stages] == [
        ["prune"], ["distill"], ["rtn", "rtn"], ["prune"], ["distill"], ["awq", "rtn"]]
    assert [s.source for s in example.stages] == ["base", "depth", "depth-kd", "base", "width", "width-kd"]
    for healed in (example.stages[1], example.stages[4]):
        assert healed.steps[0].teacher.stage == "base"          # KD from the target the drafts serve
    assert example.stages[0].steps[0].config.targets.num_hidden_layers == 2
    assert example.stages[2].steps[0].config.bits == 4
