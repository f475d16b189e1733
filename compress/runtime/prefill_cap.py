"""The prompt tokens a step that also decodes may take, sized from measured step times.

``Scheduler.max_prefill_tokens_with_decodes`` caps the prompt chunks of a step that runs
decodes, so the running requests' inter-token gap stays near a decode step's length while
a long prompt comes in (Sarathi-Serve sizes its chunks for a latency target the same way).
A fixed cap is right for one model, machine and context length only: a chunk token's cost
grows with the prompt's context (attention over every earlier position) and with the
number of rows the GEMMs already run. ``PrefillCap`` keeps the cap where a mixed step takes
about ``ratio`` times a decode-only step:

* decode-only steps give the baseline, an exponential average of their seconds;
* each mixed step gives the marginal cost of its prompt tokens, (mixed - baseline) / n,
  and the cap moves halfway (rounded towards it) to the whole tokens that cost at most
  (ratio - 1) x baseline at that rate;
* it starts at ``start`` tokens and stays within 1 .. ``limit``.

Steps without decodes (nothing to delay) and steps of other shapes are ignored.
"""
from __future__ import annotations

import math


class PrefillCap:
    def __init__(self, ratio: float, limit: int, start: int = 16, smoothing: float = 0.2):
        if not ratio > 1.0 or not math.isfinite(ratio):
            raise ValueError(f"max_itl_ratio must be a number > 1 (a mixed step's time over a decode step's), got {ratio}")
        if limit < 1:
            raise ValueError(f"the prompt-token limit must be >= 1, got {limit}")
        self.ratio, self.limit, self.smoothing = float(ratio), int(limit), float(smoothing)
        self.cap = max(1, min(int(start), self.limit))
        self.decode_seconds: float | None = None   # the baseline, once a decode-only step was seen

    def observe(self, seconds: float, decode_rows: int, prompt_tokens: int) -> int:
        """One step's time with its decode rows and prompt tokens; returns the cap for the
        next step."""
        if decode_rows == 0 or seconds <= 0:
            return self.cap
        if prompt_tokens == 0:
            d = self.decode_seconds
            self.decode_seconds = seconds if d is None else d + self.smoothing * (seconds - d)
            return self.cap
        base = self.decode_seconds
        if base is None:
            return self.cap
        per_token = max(seconds - base, 1e-6 * base) / prompt_tokens
        goal = max(1, min(self.limit, math.floor((self.ratio - 1.0) * base / per_token + 1e-9)))
        half = 0.5 * (self.cap + goal)   # halfway, rounded towards the goal: it gets there
        self.cap = math.floor(half) if goal < self.cap else math.ceil(half)
        return self.cap
