"""The report's pictures: perplexity and decode speed of every stage against its size on disk.

``pareto_front`` is the pure core: which stages no other stage beats on both axes.
``write_plots`` draws one PNG per figure next to ``report.md`` (matplotlib, Agg canvas,
no pyplot state) and returns what it wrote and, for everything it could not draw, a
note the report prints instead: matplotlib missing, a stage without the figure.

- ``perplexity_vs_size.png``: perplexity (lower is better) against size; the Pareto
  front (no other stage is both smaller and lower) joined and highlighted.
- ``decode_vs_size.png``: decode tok/s (higher is better) against size, its front
  (no other stage is both smaller and faster) highlighted the same way.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class PlotSpec:
    file: str
    title: str
    y_key: str
    y_label: str
    lower_is_better: bool


PLOTS = (
    PlotSpec("perplexity_vs_size.png", "perplexity against size on disk", "perplexity",
             "perplexity (lower is better)", lower_is_better=True),
    PlotSpec("decode_vs_size.png", "decode speed against size on disk", "decode_tok_s",
             "decode tok/s, batch 1 (higher is better)", lower_is_better=False),
)
X_KEY = "size_bytes"


@dataclass
class PlotResult:
    written: list[tuple[str, str]] = field(default_factory=list)   # (file name, title)
    notes: list[str] = field(default_factory=list)                 # what is missing and why


def pareto_front(points: list[tuple[float, float]], lower_y_is_better: bool = True) -> list[int]:
    """Indices of the points no other point dominates, ordered by x (smaller x is better).

    A point is dominated when another is at least as good on both axes and better on
    one. Equal points are all on the front (neither dominates the other)."""
    sign = 1.0 if lower_y_is_better else -1.0
    front = []
    for i, (xi, yi) in enumerate(points):
        dominated = any(xj <= xi and sign * yj <= sign * yi and (xj < xi or sign * yj < sign * yi)
                        for j, (xj, yj) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: (points[i][0], sign * points[i][1]))


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def plot_points(stages: list[dict], y_key: str) -> tuple[list[str], list[tuple[float, float]], list[str]]:
    """(names, (size, y) points, names of the stages without both figures)."""
    names, points, missing = [], [], []
    for s in stages:
        x, y = _number(s.get(X_KEY)), _number(s.get(y_key))
        if x is None or y is None or x <= 0:
            missing.append(str(s.get("name", "?")))
        else:
            names.append(str(s.get("name", "?")))
            points.append((x, y))
    return names, points, missing


def _draw(spec: PlotSpec, names: list[str], points: list[tuple[float, float]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    front = pareto_front(points, spec.lower_is_better)
    fig = Figure(figsize=(7, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    mib = [x / 2**20 for x, _ in points]
    ys = [y for _, y in points]
    off = [i for i in range(len(points)) if i not in front]
    ax.scatter([mib[i] for i in off], [ys[i] for i in off], s=36, color="#9aa5b1", label="stage", zorder=2)
    ax.plot([mib[i] for i in front], [ys[i] for i in front], "-o", color="#d1495b", markersize=7,
            label="Pareto front", zorder=3)
    for name, x, y in zip(names, mib, ys):
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for axis, values, set_scale in ((ax.xaxis, mib, ax.set_xscale), (ax.yaxis, ys, ax.set_yscale)):
        if min(values) > 0 and max(values) / min(values) > 4:     # a wide range: log scale, plain labels
            set_scale("log")
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(plain)
    ax.set_xlabel("size on disk (MiB)")
    ax.set_ylabel(spec.y_label)
    ax.set_title(spec.title)
    ax.grid(True, alpha=0.3)
    ax.margins(0.12)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_plots(stages: list[dict], out_dir: str | Path) -> PlotResult:
    """Draw every figure of :data:`PLOTS` that has points into ``out_dir``."""
    result = PlotResult()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        result.notes.append("no plots: matplotlib is not installed (pip install matplotlib)")
        return result
    out = Path(out_dir)
    for spec in PLOTS:
        names, points, missing = plot_points(stages, spec.y_key)
        if not points:
            result.notes.append(f"no {spec.title} plot: no stage has both a size and a {spec.y_key}")
            continue
        if missing:
            result.notes.append(f"{spec.title}: left out {', '.join(f'`{n}`' for n in missing)} "
                                f"(no {spec.y_key} or size measured)")
        try:
            _draw(spec, names, points, out / spec.file)
        except Exception as exc:  # noqa: BLE001  (a plot that fails must not lose the report)
            result.notes.append(f"no {spec.title} plot: {type(exc).__name__}: {exc}")
            continue
        result.written.append((spec.file, spec.title))
    return result
