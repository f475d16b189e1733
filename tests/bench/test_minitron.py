"""`compress bench minitron`: the arm plan, recovery and goals as pure functions, and a
tiny end-to-end run (prune, heal, scratch, evaluation, resume) through the CLI."""
import json
import math

import pytest

from compress.bench.minitron import MinitronSettingsError, parse_targets, parse_tokens
from compress.bench.minitron_arms import HealSettings, heal_recipe, plan_arms, token_label
from compress.bench.minitron_results import add_recovery, goals, recovery, seed_summary
from compress.cli import main


def test_recovery_is_the_share_of_the_pruning_loss_that_healing_takes_back():
    assert recovery(6.0, 4.6, 4.4) == pytest.approx(1.4 / 1.6)
    assert recovery(6.0, 4.4, 4.4) == 1.0 and recovery(6.0, 6.0, 4.4) == 0.0
    assert recovery(6.0, 6.5, 4.4) < 0                      # healing made it worse
    with pytest.raises(ValueError, match="nothing to recover"):
        recovery(4.0, 3.9, 4.4)


def row(name, family, loss, heal=None, tokens=0, seed=0, start=None):
    return {"name": name, "family": family, "heal": heal, "tokens": tokens, "seed": seed, "start": start,
            "eval_loss": loss, "perplexity": math.exp(loss), "kl": 0.1, "top1": 0.5, "parameters": 1000}


def rows_of(width_kd=(4.50, 4.52), random_kd=(4.80, 4.90), scratch_kd=(5.00, 5.10)):
    return [row("teacher", "teacher", 4.0),
            row("width", "width", 6.0), row("width-kd-1m", "width", width_kd[0], "kd", 10**6, 0, "width"),
            row("width-kd-1m-s1", "width", width_kd[1], "kd", 10**6, 1, "width"),
            row("random", "random", 7.0), row("random-s1", "random", 8.0),
            row("random-kd-1m", "random", random_kd[0], "kd", 10**6, 0, "random"),
            row("random-kd-1m-s1", "random", random_kd[1], "kd", 10**6, 1, "random-s1"),
            row("scratch-init", "scratch", 8.3),
            row("scratch-kd-1m", "scratch", scratch_kd[0], "kd", 10**6, 0, "scratch-init"),
            row("scratch-kd-1m-s1", "scratch", scratch_kd[1], "kd", 10**6, 1, "scratch-init")]


def test_recovery_of_each_arm_is_against_its_own_pruned_start():
    r = {x["name"]: x["recovery"] for x in add_recovery(rows_of())}
    assert r["width"] == 0.0 and r["width-kd-1m"] == pytest.approx(0.75)
    assert r["random-kd-1m"] == pytest.approx((7.0 - 4.8) / 3.0)
    assert r["random-kd-1m-s1"] == pytest.approx((8.0 - 4.9) / 4.0)     # its own draw's start
    assert r["teacher"] is None and r["scratch-kd-1m"] is None and r["scratch-init"] is None


def test_seed_spread_and_goals():
    rows = add_recovery(rows_of())
    spread = {(s["family"], s["heal"], s["tokens"]): s for s in seed_summary(rows)}
    assert spread[("width", "kd", 10**6)]["eval_loss"]["range"] == pytest.approx(0.02)
    assert spread[("width", "kd", 10**6)]["eval_loss"]["mean"] == pytest.approx(4.51)
    met = {g["goal"]: g["met"] for g in goals(rows)}
    assert met["importance beats random before healing"] is True
    assert met["importance beats random after KD on 1,000,000 tokens"] is True
    assert met["width + KD reaches R >= 0.8 with <= 1,000,000 tokens"] is False       # R = 0.745
    assert met["width + KD beats scratch by more than the seed spread at 1,000,000 tokens"] is True
    # a margin (0.05) inside the seed spread (0.2) is not a win
    noisy = add_recovery(rows_of(width_kd=(4.5, 4.7), scratch_kd=(4.6, 4.7)))
    met = {g["goal"]: g["met"] for g in goals(noisy)}
    assert met["width + KD beats scratch by more than the seed spread at 1,000,000 tokens"] is False
    # importance ahead of random by less than the seeds' spread (0.03) is not a win either
    close = {g["goal"]: g for g in goals(add_recovery(rows_of(width_kd=(4.50, 4.52), random_kd=(4.52, 4.55))))}
    assert close["importance beats random after KD on 1,000,000 tokens"]["met"] is False
    assert "within the spread" in close["importance beats random after KD on 1,000,000 tokens"]["detail"]


def test_the_arm_plan_runs_headline_arms_per_seed_and_starts_first():
    arms = plan_arms(["width", "depth", "random", "scratch"], [250_000, 1_000_000], [0, 1])
    names = [a.name for a in arms]
    assert names == ["teacher", "width", "width-kd-250k", "width-kd-1m", "depth", "depth-kd-250k", "depth-kd-1m",
                     "random", "random-kd-250k", "random-kd-1m",
                     "scratch-init", "scratch-ce-250k", "scratch-kd-250k", "scratch-ce-1m", "scratch-kd-1m",
                     "width-kd-1m-s1", "random-s1", "random-kd-1m-s1", "scratch-init-s1", "scratch-kd-1m-s1"]
    by = {a.name: a for a in arms}
    assert by["width-kd-1m-s1"].start == "width" and by["random-kd-1m-s1"].start == "random-s1"
    assert by["random-s1"].seed == 1 and by["scratch-kd-1m-s1"].heal == "kd"
    for a in arms:
        if a.start is not None:
            assert names.index(a.start) < names.index(a.name)
    with pytest.raises(ValueError, match="unknown arm family 'wide'"):
        plan_arms(["wide"], [1000], [0])


def test_heal_recipe_trains_kd_or_ce_with_its_own_lr():
    arms = {a.name: a for a in plan_arms(["width", "scratch"], [20_000], [3])}
    s = HealSettings(heal_lr=1e-3, scratch_lr=3e-3)
    kd = heal_recipe(arms["width-kd-20k"], "/m/width", "/t", "/m", s)["stages"][0]["steps"][0]
    ce = heal_recipe(arms["scratch-ce-20k"], "/m/scratch-init", "/t", "/m", s, "/train.txt")
    step = ce["stages"][0]["steps"][0]
    assert (kd["loss"], kd["lr"], kd["tokens"], kd["seed"], kd["teacher"]) == ({"forward_kl": 1.0, "ce": 0.0},
                                                                               1e-3, 20_000, 3, "/t")
    assert (step["loss"], step["lr"], step["weight_decay"]) == ({"forward_kl": 0.0, "ce": 1.0}, 3e-3, 0.1)
    assert ce["training"] == {"files": ["/train.txt"], "tokens": 20_000, "seq_len": 256, "seed": 3}


def test_options_are_parsed_or_refused_by_name():
    assert parse_tokens("250k,1m,20000") == [250_000, 1_000_000, 20_000]
    assert [token_label(n) for n in (250_000, 1_000_000, 20_000, 1234)] == ["250k", "1m", "20k", "1234"]
    assert parse_targets("hidden_size=96,num_attention_heads=2") == {"hidden_size": 96, "num_attention_heads": 2}
    with pytest.raises(MinitronSettingsError, match="--tokens"):
        parse_tokens("lots")
    with pytest.raises(MinitronSettingsError, match="--width-targets"):
        parse_targets("num_hidden_layers=3")


def test_a_tiny_experiment_end_to_end(tmp_path, tiny_llama_dir, capsys):
    from tiny_models import corpus_text

    text = corpus_text()
    (tmp_path / "train.txt").write_text(text)
    (tmp_path / "eval.txt").write_text(text[:3000])
    out = tmp_path / "exp"
    argv = ["bench", "minitron", "--teacher", str(tiny_llama_dir), "--out", str(out), "--tokens", "512",
            "--seeds", "0", "--arms", "width,scratch", "--threads", "1", "--batch-size", "2", "--kl-windows", "2",
            "--calib-samples", "4", "--width-targets", "hidden_size=96,intermediate_size=128,num_attention_heads=2",
            "--train-text", str(tmp_path / "train.txt"), "--eval-text", str(tmp_path / "eval.txt"),
            "--calib-text", str(tmp_path / "train.txt")]
    assert main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["teacher", "width", "width-kd-512", "scratch-init", "scratch-ce-512", "scratch-kd-512"]
    assert rows["teacher"]["kl"] == pytest.approx(0.0, abs=1e-6) and rows["teacher"]["top1"] == 1.0
    assert rows["width"]["parameters"] == rows["scratch-kd-512"]["parameters"] < rows["teacher"]["parameters"]
    for r in rows.values():
        assert r["eval_loss"] == pytest.approx(math.log(r["perplexity"]))
        assert r["kl"] >= 0 and 0 <= r["top1"] <= 1
    for name in ("width-kd-512", "scratch-ce-512", "scratch-kd-512"):
        assert rows[name]["tokens_trained"] == 512 and rows[name]["tokens_per_s"] > 0
        assert (out / "recipes" / f"{name}.yaml").is_file()
    start, healed, teacher = rows["width"]["eval_loss"], rows["width-kd-512"]["eval_loss"], rows["teacher"]["eval_loss"]
    want = recovery(start, healed, teacher) if start > teacher else None
    assert rows["width-kd-512"]["recovery"] == (pytest.approx(want) if want is not None else None)
    assert rows["scratch-kd-512"]["recovery"] is None
    assert f"| width-kd-512 | {rows['width']['parameters'] / 1e6:.2f}M | 512 |" in (out / "results.md").read_text()
    capsys.readouterr()
    # a rerun with the same settings reuses every arm
    assert main(argv) == 0
    assert capsys.readouterr().out.count("reusing") == len(rows)
    assert [r["eval_loss"] for r in json.loads((out / "results.json").read_text())["rows"]] == \
        [r["eval_loss"] for r in rows.values()]
