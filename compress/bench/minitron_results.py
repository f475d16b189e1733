"""The figures of ``compress bench minitron`` from its measured rows: recovery, seed
spreads, the issue's goals and the markdown table. Pure functions of plain dicts.

A row is one arm's record: ``name``, ``family``, ``heal``, ``tokens``, ``seed``,
``start`` and the measured ``eval_loss`` (mean NLL in nats/token on the eval text),
``perplexity``, ``kl`` (KL(teacher || arm) per token), ``top1`` (agreement with the
teacher's argmax), ``parameters``, and for trained arms ``train_seconds`` (the training
loop), ``tokens_per_s``, ``stage_seconds`` (the whole recipe run: load, data, loop,
export) and ``loadavg`` (the machine's 1-minute load average before and after).
"""
from __future__ import annotations

import statistics


def recovery(l_pruned: float, l_healed: float, l_teacher: float) -> float:
    """R = (L_pruned - L_healed) / (L_pruned - L_teacher): the share of the loss that
    pruning added which healing took back (1: back to the teacher; 0: no better than
    the pruned start; negative: worse)."""
    gap = l_pruned - l_teacher
    if gap <= 0:
        raise ValueError(f"recovery needs a pruned loss above the teacher's (L_pruned {l_pruned} <= "
                         f"L_teacher {l_teacher}): there is nothing to recover")
    return (l_pruned - l_healed) / gap


def add_recovery(rows: list[dict]) -> list[dict]:
    """Each row with ``recovery``: trained rows whose start is a pruned arm get R against
    that start; pruned starts get 0; the teacher, scratch inits and scratch arms None
    (a random init has no pruned loss to recover)."""
    by_name = {r["name"]: r for r in rows}
    teacher = by_name.get("teacher")
    out = []
    for r in rows:
        value = None
        if teacher is not None and r["family"] not in ("teacher", "scratch"):
            start = r if r.get("start") is None else by_name.get(r["start"])
            if start is not None and start["eval_loss"] > teacher["eval_loss"]:
                value = recovery(start["eval_loss"], r["eval_loss"], teacher["eval_loss"])
        out.append({**r, "recovery": value})
    return out


def spread(values: list[float]) -> dict:
    """``{"mean", "min", "max", "range", "n"}`` of one arm's figure over its seeds."""
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "range": max(values) - min(values), "n": len(values)}


def groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows that differ only by seed: ``(family, heal, tokens) -> rows``."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["family"], r["heal"], r["tokens"]), []).append(r)
    return out


def seed_summary(rows: list[dict]) -> list[dict]:
    """One line per group with two or more seeds: the spread of eval loss, KL, top-1 and R."""
    lines = []
    for (family, heal, tokens), members in groups(rows).items():
        if len(members) < 2:
            continue
        line = {"family": family, "heal": heal, "tokens": tokens, "seeds": [m["seed"] for m in members]}
        for key in ("eval_loss", "perplexity", "kl", "top1", "recovery"):
            values = [m[key] for m in members if m.get(key) is not None]
            if len(values) == len(members):
                line[key] = spread(values)
        lines.append(line)
    return lines


def _mean_of(rows_by_group: dict, key: tuple, figure: str) -> tuple[float, float] | None:
    """(mean, range) of ``figure`` over a group's seeds, or None when the group is absent."""
    members = rows_by_group.get(key)
    if not members or any(m.get(figure) is None for m in members):
        return None
    s = spread([m[figure] for m in members])
    return s["mean"], s["range"]


def goals(rows: list[dict], r_goal: float = 0.8, max_tokens: int = 1_000_000) -> list[dict]:
    """The issue's goals, each ``{"goal", "met": True | False | None (not measured), "detail"}``:
    importance (width) beats random at every budget measured (before and after healing), by
    more than the seed spread where an arm has several seeds;
    width + KD with at most ``max_tokens`` tokens reaches R >= ``r_goal``; width + KD beats
    the better scratch arm at the same budget by more than the seed spread (the larger
    range over seeds of the two arms)."""
    by = groups(rows)
    out = []
    budgets = sorted({r["tokens"] for r in rows if r["family"] == "width"})
    for n in budgets:
        heal = None if n == 0 else "kd"
        w, r = _mean_of(by, ("width", heal, n), "eval_loss"), _mean_of(by, ("random", heal, n), "eval_loss")
        when = "before healing" if n == 0 else f"after KD on {n:,} tokens"
        if w is None or r is None:
            out.append({"goal": f"importance beats random {when}", "met": None, "detail": "not measured"})
            continue
        # with several seeds of random (or of width) the margin must exceed the seed spread;
        # a deterministic width arm against one random draw can only say which is lower
        margin, noise = r[0] - w[0], max(w[1], r[1])
        seeded = len(by[("random", heal, n)]) > 1 or len(by[("width", heal, n)]) > 1
        out.append({"goal": f"importance beats random {when}", "met": margin > (noise if seeded else 0.0),
                    "detail": f"eval loss width {w[0]:.4f} vs random {r[0]:.4f} (margin {margin:+.4f}, "
                              + (f"seed ranges {w[1]:.4f} / {r[1]:.4f}"
                                 + (": within the spread" if seeded and 0 < margin <= noise else "") + ")"
                                 if seeded else "one seed: no spread measured)")})
    healed = [n for n in budgets if 0 < n <= max_tokens]
    if healed:
        n = max(healed)
        rec = _mean_of(by, ("width", "kd", n), "recovery")
        goal = f"width + KD reaches R >= {r_goal} with <= {max_tokens:,} tokens"
        if rec is None:
            out.append({"goal": goal, "met": None, "detail": "R undefined: the width-pruned loss is not above the "
                                                             "teacher's"})
        else:
            out.append({"goal": goal, "met": rec[0] >= r_goal,
                        "detail": f"R = {rec[0]:.3f} at {n:,} tokens"
                                  + (f" (mean of {len(by[('width', 'kd', n)])} seeds, range {rec[1]:.3f})"
                                     if len(by[("width", "kd", n)]) > 1 else " (one seed)")})
    else:
        out.append({"goal": f"width + KD reaches R >= {r_goal} with <= {max_tokens:,} tokens", "met": None,
                    "detail": "no width + KD arm measured"})
    for n in healed:
        w = _mean_of(by, ("width", "kd", n), "eval_loss")
        scratch = {heal: _mean_of(by, ("scratch", heal, n), "eval_loss") for heal in ("kd", "ce")}
        scratch = {k: v for k, v in scratch.items() if v is not None}
        goal = f"width + KD beats scratch by more than the seed spread at {n:,} tokens"
        if not scratch:
            out.append({"goal": goal, "met": None, "detail": "no scratch arm measured"})
            continue
        heal, best = min(scratch.items(), key=lambda kv: kv[1][0])
        margin, noise = best[0] - w[0], max(best[1], w[1])
        single = len(by[("width", "kd", n)]) < 2 or len(by[("scratch", heal, n)]) < 2
        out.append({"goal": goal, "met": None if single else margin > noise,
                    "detail": f"eval loss width+KD {w[0]:.4f} vs scratch-{heal} {best[0]:.4f}: margin {margin:+.4f} "
                              + ("(one seed: no spread measured)" if single else f"vs seed spread {noise:.4f}")})
    return out


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


COLUMNS = ("arm", "params", "tokens", "eval ppl", "eval loss", "KL to teacher", "top-1 agree", "R",
           "train tok/s", "train s", "run s", "load avg")


def table_row(r: dict) -> list[str]:
    load = r.get("loadavg")
    return [r["name"], f"{r['parameters'] / 1e6:.2f}M", f"{r['tokens']:,}" if r["tokens"] else "0",
            _fmt(r.get("perplexity"), ".2f"), _fmt(r.get("eval_loss"), ".4f"), _fmt(r.get("kl"), ".4f"),
            _fmt(r.get("top1"), ".3f"), _fmt(r.get("recovery"), ".3f"), _fmt(r.get("tokens_per_s"), ".0f"),
            _fmt(r.get("train_seconds"), ".0f"), _fmt(r.get("stage_seconds"), ".0f"),
            "" if not load else f"{load[0]:.1f}-{load[1]:.1f}"]


def markdown(rows: list[dict], goal_lines: list[dict], summary: list[dict], notes: list[str]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(table_row(r)) + " |" for r in rows]
    if summary:
        lines += ["", "Seed spread (mean, min-max over seeds):", "",
                  "| arm group | seeds | eval loss | eval ppl | KL | top-1 | R |", "|---|---|---|---|---|---|---|"]
        for s in summary:
            name = f"{s['family']}-{s['heal']}-{s['tokens']:,}"

            def cell(key, spec):
                v = s.get(key)
                return "" if v is None else f"{v['mean']:{spec}} ({v['min']:{spec}}-{v['max']:{spec}})"
            lines.append(f"| {name} | {','.join(map(str, s['seeds']))} | {cell('eval_loss', '.4f')} | "
                         f"{cell('perplexity', '.2f')} | {cell('kl', '.4f')} | {cell('top1', '.3f')} | "
                         f"{cell('recovery', '.3f')} |")
    lines += ["", "Goals:", ""]
    for g in goal_lines:
        mark = {True: "met", False: "NOT met", None: "not measured"}[g["met"]]
        lines.append(f"- {g['goal']}: **{mark}** ({g['detail']})")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
