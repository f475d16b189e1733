"""evals.bootstrap and `compress eval PATH --base BASE --bootstrap OTHER...`: the ratio of
two checkpoints' perplexity gaps to a base, with a bootstrap interval over windows."""
import json

import pytest
import torch

from compress.cli import main
from evals.bootstrap import gap_ratio_interval

from eval_models import make_model_dir


def test_gap_ratio_interval_is_the_ratio_of_summed_gaps():
    g = torch.Generator().manual_seed(0)
    base = torch.rand(200, generator=g, dtype=torch.float64) * 10 + 100
    other = base + 1.0 + 0.5 * torch.rand(200, generator=g, dtype=torch.float64)
    path = base + 0.4 * (other - base) + 0.05 * torch.randn(200, generator=g, dtype=torch.float64)
    ratio, low, high = gap_ratio_interval(base, path, other, reps=500, seed=3)
    assert ratio == pytest.approx(float((path - base).sum() / (other - base).sum()))
    assert low < ratio < high and 0.35 < low and high < 0.45
    assert gap_ratio_interval(base, path, other, reps=500, seed=3) == (ratio, low, high)
    assert gap_ratio_interval(base, path, other, reps=500, seed=4) != (ratio, low, high)
    # a wider coverage gives a wider interval around the same ratio
    _, low99, high99 = gap_ratio_interval(base, path, other, reps=500, seed=3, level=0.99)
    assert low99 < low and high < high99


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """Two copies of the tiny model with more and less noise in every weight."""
    root = tmp_path_factory.mktemp("damaged")
    return make_model_dir(root / "less", noise=0.01), make_model_dir(root / "more", noise=0.04)


def test_eval_bootstrap_cli(tiny_model_dir, tiny_text, damaged, tmp_path, capsys):
    less, more = damaged
    out = tmp_path / "gap.json"
    argv = ["eval", str(less), "--base", str(tiny_model_dir), "--bootstrap", str(more), "--text", str(tiny_text),
            "--seq-len", "16", "--kernels", "reference", "--threads", "1", "--bootstrap-reps", "300",
            "--json", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["seq_len"] == 16 and record["windows"] >= 2
    assert set(record["perplexity"]) == {str(tiny_model_dir), str(less), str(more)}
    (c,) = record["comparisons"]
    assert (c["path"], c["other"], c["reps"], c["level"]) == (str(less), str(more), 300, 0.9)
    assert c["low"] <= c["ratio"] <= c["high"]
    printed = capsys.readouterr().out
    assert f"gap({less}) / gap({more}) = {c['ratio']:.3f}" in printed
    # deterministic with the seed
    assert main(argv) == 0 and json.loads(out.read_text()) == record


def test_eval_bootstrap_needs_a_base_and_enough_text(tiny_model_dir, tiny_text, damaged, tmp_path, capsys):
    less, more = damaged
    assert main(["eval", str(less), "--bootstrap", str(more)]) == 2
    assert "--base" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("Return the absolute value.", encoding="utf-8")
    assert main(["eval", str(less), "--base", str(tiny_model_dir), "--bootstrap", str(more), "--text", str(short),
                 "--seq-len", "16", "--kernels", "reference"]) == 2
    err = capsys.readouterr().err
    assert "fewer than 2 windows" in err and "--seq-len 16" in err
    # windows longer than the models' context (128)
    assert main(["eval", str(less), "--base", str(tiny_model_dir), "--bootstrap", str(more), "--text",
                 str(tiny_text), "--seq-len", "200", "--kernels", "reference"]) == 2
    assert "--seq-len 200 is longer than" in capsys.readouterr().err
