import json

import pytest

from evals.report import render_markdown, write_report

STAGES = [
    {"name": "base", "path": "/ckpt/base", "parameters": 6_000_000, "size_bytes": 24_000_000, "bits_per_weight": 32.0,
     "perplexity": 12.5, "kl_to_base": 0.0, "top1_agreement": 1.0, "prefill_tok_s": 5000.0,
     "decode_tok_s": 120.0, "tasks": {"pydoc_cloze": {"acc": 0.61, "acc_stderr": 0.03},
                                      "pydoc_ppl": {"word_perplexity": 40.1}}},
    {"name": "rtn_int4", "path": "/ckpt/int4", "parameters": 6_000_000, "size_bytes": 4_000_000, "bits_per_weight": 4.25,
     "perplexity": 13.1, "kl_to_base": 0.031, "top1_agreement": 0.93, "prefill_tok_s": None,
     "decode_tok_s": float("nan"), "tasks": {"pydoc_cloze": {"acc": 0.58}}, "extra": [1, 2]},
]


def test_write_report_json_and_markdown(tmp_path):
    j, m = write_report(STAGES, tmp_path / "out", machine={"threads": 2, "cpus": 2})
    data = json.loads(j.read_text())
    assert [s["name"] for s in data["stages"]] == ["base", "rtn_int4"]
    assert data["stages"][1]["decode_tok_s"] is None and data["stages"][1]["extra"] == [1, 2]
    md = m.read_text()
    assert "| `base` | 6.00M | 22.89 MiB | 32.00 | 12.500 | 0.00000 | 100.00% | 5,000 | 120.0 |" in md
    assert "| pydoc_cloze | acc | 0.6100 ± 0.0300 | 0.5800 |" in md
    assert "| pydoc_ppl | word_perplexity | 40.1000 | — |" in md
    assert "2 threads" in md and "KL to base" in md
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "decode_vs_size.png", "perplexity_vs_size.png", "report.json", "report.md"]


def test_first_stage_must_be_base(tmp_path):
    with pytest.raises(ValueError, match="base"):
        write_report(STAGES[::-1], tmp_path)
    with pytest.raises(ValueError):
        write_report([], tmp_path)
    assert not list(tmp_path.iterdir())


def test_markdown_without_tasks():
    md = render_markdown([{"name": "base"}], machine={})
    assert "| `base` | — | — |" in md and "Tasks" not in md


def test_int4_activation_precision_is_recorded_per_stage():
    """Which activation precision the runtime's int4 layers ran with is a column beside the
    figures it produced (— for a stage without int4 layers)."""
    md = render_markdown([{"name": "base", "decode_tok_s": 120.0},
                          {"name": "rtn-int4", "decode_tok_s": 150.0, "w4_activations": "float"},
                          {"name": "rtn-int4-fast", "decode_tok_s": 190.0, "w4_activations": "int8"}], machine={})
    assert "| int4 activations |" in md.splitlines()[2]
    assert "| 120.0 | — |" in md and "| 150.0 | float |" in md and "| 190.0 | int8 |" in md
    assert "**int4 activations**" in md


def test_a_small_positive_kl_never_reads_as_zero():
    """A near-lossless stage's KL (int8 on a large model) keeps its digits beside the base's
    exact 0; ordinary values keep 5 decimals."""
    from evals.report import _fmt

    assert _fmt(0.0, "small") == "0.00000" and _fmt(4e-6, "small") == "4.00e-06"
    assert _fmt(0.00027, "small") == "0.00027"
