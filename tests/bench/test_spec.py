"""`compress bench spec` on a tiny model: the target as its own draft (every draft token
accepted) and prompt lookup, batch 1, a few tokens; the JSON has the documented fields
and the speculative outputs equal the target alone's (speed is never asserted)."""
from __future__ import annotations

import argparse
import json

import pytest

from compress.bench import add_bench_parser, spec
from compress.bench.spec_timing import expected_tokens, predicted_speedup


def _parser():
    p = argparse.ArgumentParser()
    add_bench_parser(p.add_subparsers(dest="command"))
    return p


def test_prediction_formula():
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert predicted_speedup(0.5, 1, 0.25, 1.25) == pytest.approx(1.0)


def test_bench_spec_self_draft_and_ngram(tmp_path, tiny_llama_dir, one_thread):
    text = tmp_path / "eval.txt"
    text.write_text(" ".join(f"def f{i}(x): return x + {i}" for i in range(200)))
    out = tmp_path / "spec.json"
    a = _parser().parse_args(["bench", "spec", "--target", str(tiny_llama_dir), "--draft", str(tiny_llama_dir),
                              "--draft", "ngram", "--k", "2", "--batch", "1", "--new-tokens", "6",
                              "--prompt-len", "12", "--prompts", str(text), "--min-prompts", "2", "--repeats", "1",
                              "--timing-repeats", "2", "--no-peer", "--json", str(out)])
    assert a.func is spec.main
    log = []
    result = spec.run(a, log=log.append)
    saved = json.loads(out.read_text())
    assert saved["records"] == json.loads(json.dumps(result["records"]))
    recs = {r["draft"]: r for r in saved["records"]}
    assert set(recs) == {str(tiny_llama_dir), "ngram"}
    for r in recs.values():
        assert (r["k"], r["batch"]) == (2, 1)
        assert r["identical"] is True
        for f in ("alpha", "alpha_token", "mean_accepted", "spec_step_ms", "spec_passes_ms", "tokens_per_pass", "c", "v", "predicted_speedup", "target_tok_s",
                  "spec_tok_s", "measured_speedup"):
            assert isinstance(r[f], float) and r[f] >= 0, f
        assert r["v"] > 0 and r["target_tok_s"] > 0 and r["spec_tok_s"] > 0
    self_draft = recs[str(tiny_llama_dir)]
    assert self_draft["alpha"] == self_draft["alpha_token"] == 1.0      # the draft is the target
    assert self_draft["counters"]["spec_rejections"] == 0
    # every proposed token kept (fewer than k where max_tokens leaves less room), plus one
    assert self_draft["mean_accepted"] == self_draft["proposed_per_row"] > 1.0
    assert self_draft["tokens_per_pass"] == self_draft["mean_accepted"] + 1
    assert self_draft["counters"]["draft_forwards"] > 0 and self_draft["c"] > 0
    assert recs["ngram"]["c"] == 0.0
    assert saved["identical"] is True and saved["target_costs"]["1"]["step_ms"] > 0
    assert any(line.startswith("| draft | k | batch") for line in log)
    assert any("goal:" in line for line in saved["summary"])
