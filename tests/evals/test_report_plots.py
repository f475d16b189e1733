"""The report's plots: the Pareto front as a pure function, the PNGs and their links."""
import builtins
import struct

import pytest

from evals.report import write_report
from evals.report_plots import pareto_front, plot_points, write_plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def stage(name, size, ppl=None, decode=None, params=1_000_000):
    return {"name": name, "parameters": params, "size_bytes": size, "perplexity": ppl, "decode_tok_s": decode}


STAGES = [stage("base", 27e6, 10.0, 300.0, 6.8e6), stage("pruned", 15e6, 14.0, 500.0, 3.8e6),
          stage("healed", 15e6, 11.0, 510.0, 3.8e6), stage("awq-int4", 4e6, 11.6, 900.0, 3.8e6),
          stage("llm-int8", 6e6, 11.1, 450.0, 3.8e6), stage("rtn-int8-base", 8e6, 12.0, 400.0)]


def png_size(path):
    """(width, height) from the IHDR chunk of a PNG file, after checking its signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def test_pareto_front_lower_is_better():
    points = [(27, 10.0), (15, 14.0), (15, 11.0), (4, 11.6), (6, 11.1), (8, 12.0)]
    # (15, 14) is beaten by (15, 11); (8, 12) by (6, 11.1); the rest trade size for perplexity
    assert pareto_front(points) == [3, 4, 2, 0]


def test_pareto_front_higher_is_better_and_ties():
    points = [(27, 300.0), (15, 500.0), (15, 510.0), (4, 900.0), (6, 450.0)]
    assert pareto_front(points, lower_y_is_better=False) == [3]       # smallest and fastest
    assert pareto_front([(1, 1.0), (1, 1.0), (2, 0.5)]) == [0, 1, 2]  # equal points do not dominate each other
    assert pareto_front([(1, 2.0), (1, 1.0)]) == [1]                  # same size, better figure
    assert pareto_front([]) == []


def test_points_leave_out_stages_without_the_figure():
    stages = STAGES + [stage("broken", 5e6, None), stage("nan", 5e6, float("nan")), stage("nosize", None, 9.0)]
    names, points, missing = plot_points(stages, "perplexity")
    assert names == [s["name"] for s in STAGES] and len(points) == len(STAGES)
    assert missing == ["broken", "nan", "nosize"]


def test_report_writes_valid_pngs_and_links_them(tmp_path):
    pytest.importorskip("matplotlib")
    stages = STAGES + [stage("failed", 5e6, None, None)]
    _, md_path = write_report(stages, tmp_path, machine={})
    md = md_path.read_text()
    for name in ("perplexity_vs_size.png", "decode_vs_size.png"):
        width, height = png_size(tmp_path / name)
        assert width > 300 and height > 200
        assert f"]({name})" in md
    assert "left out `failed`" in md
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]     # no temporary files left
    assert "| parameters |" in md.splitlines()[2] and "| `pruned` | 3.80M |" in md


def test_without_matplotlib_the_report_says_so(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    _, md_path = write_report(STAGES, tmp_path, machine={})
    assert "matplotlib is not installed" in md_path.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]


def test_no_stage_with_a_figure_is_a_note_not_a_plot(tmp_path):
    pytest.importorskip("matplotlib")
    result = write_plots([stage("base", 27e6)], tmp_path)
    assert result.written == [] and len(result.notes) == 2
    assert "no stage has both a size and a perplexity" in result.notes[0]
    assert not list(tmp_path.iterdir())
