"""The command line end to end on a tiny model: run (with report), inspect, generate, eval, errors."""
import json

import pytest
import yaml

from compress.cli import main

TEXT = "Return a new list containing all items from the iterable in ascending order. " * 60


@pytest.fixture()
def recipe(tmp_path, tiny_llama_dir):
    (tmp_path / "calib.txt").write_text(TEXT)
    (tmp_path / "eval.txt").write_text(TEXT[::-1])
    doc = {"name": "tiny", "model": {"path": str(tiny_llama_dir)},
           "calibration": {"files": ["calib.txt"], "samples": 4, "seq_len": 32},
           "stages": [{"name": "rtn-int8", "steps": [{"method": "rtn", "bits": 8}]},
                      {"name": "rtn-int4", "steps": [{"method": "rtn", "bits": 4, "group_size": 128}]}],
           "export": {"output": "out"},
           "eval": {"perplexity": {"file": "eval.txt", "seq_len": 64, "stride": 32},
                    "kl": {"file": "eval.txt", "windows": 2, "seq_len": 64},
                    "tasks": ["pydoc_cloze"], "task_limit": 4,
                    "speed": {"prompt_len": 8, "new_tokens": 4, "repeats": 1, "warmup": 0}}}
    p = tmp_path / "recipe.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


@pytest.mark.slow
def test_run_writes_report_with_every_stage_and_is_reproducible(recipe, tmp_path, capsys):
    out = tmp_path / "o1"
    assert main(["run", str(recipe), "--output", str(out), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    stages = report["stages"]
    assert [s["name"] for s in stages] == ["base", "rtn-int8", "rtn-int4"]
    for s in stages:
        for key in ("size_bytes", "bits_per_weight", "perplexity", "kl_to_base", "tasks",
                    "prefill_tok_s", "decode_tok_s", "path"):
            assert key in s, key
        assert s["perplexity"] > 1 and s["decode_tok_s"] > 0
        assert "pydoc_cloze" in s["tasks"]
    base, int8, int4 = stages
    assert base["kl_to_base"] == 0 and int8["kl_to_base"] > 0 and int4["kl_to_base"] > int8["kl_to_base"]
    assert base["bits_per_weight"] == 32 and 8 < int8["bits_per_weight"] < 8.5 and 4 < int4["bits_per_weight"] < 4.6
    assert int4["size_bytes"] < int8["size_bytes"] < base["size_bytes"]
    md = (out / "report.md").read_text()
    assert "rtn-int4" in md and "rtn-int8" in md
    assert (out / "rtn-int4" / "recipe.yaml").is_file()

    # same recipe again: same figures, speeds aside
    out2 = tmp_path / "o2"
    assert main(["run", str(recipe), "--output", str(out2), "--quiet"]) == 0
    again = json.loads((out2 / "report.json").read_text())["stages"]
    for a, b in zip(stages, again):
        assert a["perplexity"] == b["perplexity"] and a["kl_to_base"] == b["kl_to_base"] and a["tasks"] == b["tasks"]

    capsys.readouterr()
    assert main(["inspect", str(out / "rtn-int4")]) == 0
    text = capsys.readouterr().out
    assert "w4a16" in text and "model.layers.0.self_attn.q_proj" in text

    assert main(["generate", str(out / "rtn-int4"), "--prompt", "Return a", "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("Return a")

    # compress eval on the export against the base: same KL as the report's
    rec_file = tmp_path / "eval.json"
    assert main(["eval", str(out / "rtn-int4"), "--base", base["path"], "--text", str(recipe.parent / "eval.txt"),
                 "--seq-len", "64", "--tasks", "--no-speed", "--json", str(rec_file)]) == 0
    base_rec, int4_rec = json.loads(rec_file.read_text())
    assert base_rec["kl_to_base"] == 0 and int4_rec["kl_to_base"] > 0
    assert "rtn-int4" in capsys.readouterr().out


def test_dry_run_and_errors(recipe, tmp_path, capsys):
    assert main(["run", str(recipe), "--dry-run"]) == 0
    assert "2 stage(s)" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"model": {"path": str(tmp_path / "missing")}, "steps": [{"method": "rtn"}]}))
    assert main(["run", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "error" in err and "missing" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err


def test_run_with_a_failed_cell_writes_the_report_and_exits_1(recipe, tmp_path, capsys, monkeypatch):
    """A measurement that fails costs its cell, not the report; the command still says so."""
    import evals.speed

    def broken(*args, **kwargs):
        raise RuntimeError("speed meter broke")

    monkeypatch.setattr(evals.speed, "measure_speed", broken)
    doc = yaml.safe_load(recipe.read_text())
    doc["stages"] = doc["stages"][:1]
    doc["eval"] = {"perplexity": {"file": "eval.txt", "seq_len": 64, "stride": 32}, "kl": None,
                   "speed": {"prompt_len": 8, "new_tokens": 4, "repeats": 1, "warmup": 0}}
    recipe.write_text(yaml.safe_dump(doc))
    out = tmp_path / "o"
    assert main(["run", str(recipe), "--output", str(out), "--quiet"]) == 1
    stages = json.loads((out / "report.json").read_text())["stages"]
    assert [s["name"] for s in stages] == ["base", "rtn-int8"]
    assert all(s["perplexity"] > 1 and "speed meter broke" in str(s["errors"]["speed"]) for s in stages)


# ---------------------------------------------------------------- generate --draft (speculative decoding)
def _generate(capsys, *extra):
    from compress.serve.cli import EMBEDDED_MODEL

    capsys.readouterr()
    code = main(["generate", str(EMBEDDED_MODEL), "--prompt", "Return the", "--prompt", "Create a new",
                 "--max-tokens", "12", "--temperature", "0", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_with_a_draft_is_lossless_and_reports_acceptance(capsys):
    """Greedy output with --draft (the target itself, or prompt lookup) is the output
    without; stderr gets one line of acceptance figures."""
    from compress.serve.cli import EMBEDDED_MODEL

    code, plain, plain_err = _generate(capsys)
    assert code == 0 and plain.startswith("Return the") and "speculative" not in plain_err
    code, out, err = _generate(capsys, "--draft", str(EMBEDDED_MODEL))
    assert code == 0 and out == plain
    [line] = [ln for ln in err.splitlines() if "speculative" in ln]
    assert "(model, k=3)" in line and "acceptance rate" in line and "mean tokens per step" in line
    rate = float(line.split("acceptance rate ")[1].split()[0])
    assert rate > 0.5          # the target drafting for itself: (nearly) every draft token is kept
    code, out, err = _generate(capsys, "--draft", "ngram", "--num-speculative-tokens", "2")
    assert code == 0 and out == plain
    assert "(ngram, k=2)" in err and "acceptance rate" in err


def test_generate_draft_errors_are_one_line(capsys, tmp_path, tiny_llama_dir):
    missing = tmp_path / "no-such-draft"
    code, out, err = _generate(capsys, "--draft", str(missing))
    assert code == 2 and str(missing) in err and "--draft" in err and "Traceback" not in err and out == ""
    code, _, err = _generate(capsys, "--draft", str(tmp_path))           # a directory, not a model
    assert code == 2 and str(tmp_path) in err and "config.json" in err
    code, _, err = _generate(capsys, "--draft", str(tiny_llama_dir))     # another tokenizer
    assert code == 2 and str(tiny_llama_dir) in err and "vocabulary" in err and "Traceback" not in err
    code, _, err = _generate(capsys, "--num-speculative-tokens", "2")
    assert code == 2 and "--draft" in err
    code, _, err = _generate(capsys, "--draft", "ngram", "--num-speculative-tokens", "0")
    assert code == 2 and "--num-speculative-tokens" in err


def test_generate_penalties_and_their_errors(capsys):
    """--repetition-penalty changes the embedded model's greedy text; a value out of range
    is one line naming its flag, before the model loads."""
    code, plain, _ = _generate(capsys)
    code, penalized, _ = _generate(capsys, "--repetition-penalty", "1.3", "--frequency-penalty", "0.5")
    assert code == 0 and penalized.startswith("Return the") and penalized != plain
    for flag, value in (("--presence-penalty", "3"), ("--repetition-penalty", "0"), ("--temperature", "-1")):
        code, out, err = _generate(capsys, flag, value)
        assert code == 2 and f"{flag} must be" in err and "Traceback" not in err and out == ""
