"""Per-step records of the engine (``LLMEngine.step_log``): where a serving run's
seconds went. Each plain step (not a speculative one) adds its end time, the seconds of
its forward pass, its decode rows and its prompt tokens; ``summary`` splits them into
decode-only, mixed (decode rows beside prompt chunks) and prefill-only steps, and
``text`` writes them as tab-separated lines (``compress serve --step-log FILE`` writes it
when the server stops)."""
from __future__ import annotations

import statistics
from collections import deque

KINDS = ("decode-only", "mixed", "prefill-only")
HEADER = "end_time\tforward_seconds\tdecode_rows\tprompt_tokens"


class StepLog:
    def __init__(self, max_steps: int = 1_000_000):
        self.rows: deque[tuple[float, float, int, int]] = deque(maxlen=max_steps)   # the newest kept

    def add(self, end_time: float, seconds: float, decode_rows: int, prompt_tokens: int) -> None:
        self.rows.append((end_time, seconds, decode_rows, prompt_tokens))

    def text(self) -> str:
        return "\n".join([HEADER] + [f"{t:.6f}\t{s:.6f}\t{d}\t{p}" for t, s, d, p in self.rows]) + "\n"

    def summary(self) -> dict:
        """Per kind: steps, forward seconds, decode rows, prompt tokens and the median step
        in ms; plus ``wall_seconds`` from the first step's start to the last one's end."""
        out: dict = {}
        for kind in KINDS:
            rows = [r for r in self.rows if _kind(r[2], r[3]) == kind]
            out[kind] = {"steps": len(rows), "seconds": sum(r[1] for r in rows),
                         "decode_rows": sum(r[2] for r in rows), "prompt_tokens": sum(r[3] for r in rows),
                         "median_ms": statistics.median(r[1] for r in rows) * 1e3 if rows else None}
        first, last = (self.rows[0], self.rows[-1]) if self.rows else (None, None)
        out["wall_seconds"] = last[0] - (first[0] - first[1]) if first else 0.0
        return out

    def summary_lines(self) -> list[str]:
        s = self.summary()
        lines = [f"{len(self.rows)} steps over {s['wall_seconds']:.2f} s:"]
        for kind in KINDS:
            k = s[kind]
            if k["steps"]:
                lines.append(f"  {kind}: {k['steps']} steps, {k['seconds']:.2f} s (median {k['median_ms']:.1f} ms), "
                             f"{k['decode_rows']} decode rows, {k['prompt_tokens']} prompt tokens")
        return lines


def _kind(decode_rows: int, prompt_tokens: int) -> str:
    if prompt_tokens == 0:
        return "decode-only"
    return "mixed" if decode_rows else "prefill-only"
