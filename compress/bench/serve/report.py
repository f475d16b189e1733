"""From timed requests to the figures of ``vllm bench serve``, ratios between peers, and
a markdown table.

* TTFT: issue -> first token chunk; TPOT: (end - first token) / (output tokens - 1),
  per request; ITL: every gap between token chunks, all requests pooled; E2E: issue ->
  end of the stream. Each as mean and p50 / p90 / p99 in milliseconds.
* Throughput over the run's wall time (first issue -> last end): requests/s, output
  tokens/s, prompt + output tokens/s.
* ``long-prompt``: the gaps of the running requests that end while the long prompt is
  being prefilled (from its issue to its first token) against their median gap outside
  that window.

Percentiles interpolate linearly between order statistics (numpy's default)."""
from __future__ import annotations

import math
from typing import Iterable, Sequence

from compress.bench.serve.client import RequestResult

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2e")
CHUNKS_PER_TOKEN_OK = 0.95   # fewer token chunks per token than this: the stream's timings are not per token


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear between order statistics;
    NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q}: must be within 0..100")
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float]:
    """mean and the percentiles of seconds, in milliseconds."""
    out = {"mean": (sum(values_s) / len(values_s) * 1e3) if values_s else math.nan}
    out.update({f"p{q}": percentile(values_s, q) * 1e3 for q in PERCENTILES})
    return out


def summarize(results: Sequence[RequestResult]) -> dict:
    """The figures of one run of a workload against one peer."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    start = min((r.issued for r in results), default=0.0)
    end = max((r.end for r in results), default=0.0)
    duration = max(end - start, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary = {
        "completed": len(ok), "failed": len(failed), "duration_s": duration,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        # requests whose generated length differs from the asked (ignore_eos not honoured)
        "output_len_mismatches": sum(1 for r in ok if r.output_tokens != r.max_tokens),
        # token chunks per generated token: 1 when the server streams every token as it
        # comes; less when it holds tokens back (e.g. sends only tokens that add text),
        # and then TTFT / TPOT / ITL time chunks of text, not tokens
        "chunks_per_token": sum(len(r.token_times) for r in ok) / out_tokens if out_tokens else math.nan,
        "ttft_ms": distribution_ms([r.ttft for r in ok if r.token_times]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": distribution_ms([g for r in ok for g in r.itls]),
        "e2e_ms": distribution_ms([r.e2e for r in ok]),
        "errors": sorted({r.error for r in failed if r.error})[:5],
    }
    return summary


THROUGHPUTS = ("request_throughput", "output_throughput", "total_token_throughput")


def summarize_rounds(rounds: Sequence[Sequence[RequestResult]]) -> dict:
    """Several runs of the same load: latencies over all their requests pooled,
    throughputs the median of the runs' (each run's own in ``rounds``)."""
    per_round = [summarize(r) for r in rounds]
    out = summarize([r for run in rounds for r in run])
    for key in THROUGHPUTS:
        out[key] = percentile([s[key] for s in per_round], 50)
    out["duration_s"] = sum(s["duration_s"] for s in per_round)
    out["rounds"] = [{k: s[k] for k in ("duration_s", "completed", "failed", *THROUGHPUTS)} for s in per_round]
    return out


def long_prompt_stall(rounds: Sequence[Sequence[RequestResult]]) -> dict | None:
    """The running requests' inter-token gaps while the long prompt was prefilled (the
    gaps that overlap the window from its issue to its first token), beside their
    median gap outside that window, pooled over ``rounds`` (runs of the scenario);
    None when no run had a long request and running ones that streamed tokens."""
    during, outside, long_ttfts, windows, still_running = [], [], [], [], []
    for results in rounds:
        longs = [r for r in results if r.role == "long" and r.ok and r.token_times]
        running = [r for r in results if r.role == "running" and r.ok and r.token_times]
        if not longs or not running:
            continue
        long = longs[0]
        lo, hi = long.issued, long.token_times[0]
        long_ttfts.append(long.ttft)
        windows.append(hi - lo)
        still_running.append(sum(1 for r in running if r.token_times[-1] > hi))
        for r in running:
            for a, b in zip(r.token_times, r.token_times[1:]):
                (during if b > lo and a < hi else outside).append(b - a)
    if not long_ttfts:
        return None
    median_outside = percentile(outside, 50)
    p99_during = percentile(during, 99)
    return {"long_prompt_tokens": longs[0].prompt_len, "runs": len(long_ttfts),
            "long_ttft_ms": percentile(long_ttfts, 50) * 1e3, "window_ms": percentile(windows, 50) * 1e3,
            "gaps_during": len(during), "gaps_outside": len(outside),
            "itl_median_outside_ms": median_outside * 1e3, "itl_p50_during_ms": percentile(during, 50) * 1e3,
            "itl_p99_during_ms": p99_during * 1e3, "itl_max_during_ms": max(during, default=math.nan) * 1e3,
            "p99_during_over_median": p99_during / median_outside if median_outside > 0 else math.nan,
            # running requests still decoding when the long prompt's first token came (fewest of the runs)
            "running_at_first_token": min(still_running)}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else None


BASELINES = ("ours-serial", "llamacpp", "ours-no-prefix-cache", "ours-no-chunking")


def add_ratios(rows: list[dict], baselines: Iterable[str] = BASELINES) -> None:
    """For every row, ``vs_<baseline>``: its output-token throughput, its mean TTFT and
    its TTFT / TPOT p50 divided by the baseline peer's at the same load."""
    for base in baselines:
        by_load = {(r["load"], r["workload"]): r for r in rows if r["peer"] == base}
        for r in rows:
            b = by_load.get((r["load"], r["workload"]))
            if b is None:
                continue
            r[f"vs_{base}"] = {"output_throughput": _ratio(r["output_throughput"], b["output_throughput"]),
                               "ttft_mean": _ratio(r["ttft_ms"]["mean"], b["ttft_ms"]["mean"]),
                               "ttft_p50": _ratio(r["ttft_ms"]["p50"], b["ttft_ms"]["p50"]),
                               "tpot_p50": _ratio(r["tpot_ms"]["p50"], b["tpot_ms"]["p50"])}


def _fmt(x: float | None, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def _pcts(d: dict) -> str:
    return "/".join(_fmt(d[f"p{q}"]) for q in PERCENTILES)


def markdown_table(rows: Sequence[dict], baselines: Sequence[str] = BASELINES) -> str:
    """One line per peer and load: latency percentiles (ms, p50/p90/p99), throughput,
    and against each baseline present the ratios of output throughput and of mean TTFT
    (``-`` where the baseline has no row at that load)."""
    present = [b for b in baselines if any(r["peer"] == b for r in rows)]
    head = (["peer", "workload", "load", "ok/fail", "TTFT ms", "TPOT ms", "ITL ms", "E2E ms", "req/s", "out tok/s"]
            + [f"vs {b}: out tok/s, TTFT mean" for b in present])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["peer"], r["workload"], r["load"], f"{r['completed']}/{r['failed']}", _pcts(r["ttft_ms"]),
                 _pcts(r["tpot_ms"]), _pcts(r["itl_ms"]), _pcts(r["e2e_ms"]), _fmt(r["request_throughput"], 2),
                 _fmt(r["output_throughput"], 1)]
        for b in present:
            ratios = r.get(f"vs_{b}") or {}
            cells.append(", ".join("-" if ratios.get(k) is None else f"{ratios[k]:.2f}x"
                                   for k in ("output_throughput", "ttft_mean")))
        lines.append("| " + " | ".join(cells) + " |")
    flagged = dict.fromkeys(r["peer"] for r in rows if r.get("chunks_per_token", 1.0) < CHUNKS_PER_TOKEN_OK)
    if flagged:
        lines.append("")
    for peer in flagged:
        worst = min(r["chunks_per_token"] for r in rows if r["peer"] == peer)
        lines.append(f"note: {peer} streamed as few as {worst:.2f} chunks per generated token: its TTFT, TPOT and "
                     "ITL time the chunks it sent, not its tokens (throughput and E2E are unaffected)")
    return "\n".join(lines)


def long_prompt_table(rows: Sequence[dict]) -> str:
    """The long-prompt stall of each peer: running requests' ITL during the long
    prefill against their median outside it."""
    have = [r for r in rows if r.get("long_prompt")]
    if not have:
        return ""
    head = ["peer", "long TTFT ms", "ITL median outside ms", "ITL p50 during ms", "ITL p99 during ms",
            "p99 during / median", "gaps during", "running at long's 1st token"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in have:
        s = r["long_prompt"]
        lines.append("| " + " | ".join([r["peer"], _fmt(s["long_ttft_ms"]), _fmt(s["itl_median_outside_ms"], 1),
                                        _fmt(s["itl_p50_during_ms"], 1), _fmt(s["itl_p99_during_ms"], 1),
                                        _fmt(s["p99_during_over_median"], 2), str(s["gaps_during"]),
                                        str(s["running_at_first_token"])]) + " |")
    return "\n".join(lines)


def kv_reserve_lines(rows: Sequence[dict]) -> str:
    """One line per row with a KV reserve figure (our servers): KV slots held past the
    running sequences' computed positions, per running sequence, sampled from /metrics."""
    lines = []
    for r in rows:
        kv = r.get("kv_reserve")
        if kv:
            bs = kv["block_size"] or float("nan")
            lines.append(f"KV reserved beyond use, {r['peer']} {r['load']}: mean "
                         f"{kv['reserved_unused_per_seq_mean']:.1f} slots a running sequence "
                         f"({kv['reserved_unused_per_seq_mean'] / bs:.2f} blocks of {bs:g}), max "
                         f"{kv['reserved_unused_per_seq_max']:.1f} ({kv['reserved_unused_per_seq_max'] / bs:.2f} blocks); "
                         f"{kv['samples']} samples, at most {kv['blocks_used_max']:g} blocks in use")
    return "\n".join(lines)
