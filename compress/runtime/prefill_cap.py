"""The prompt tokens a step that also decodes may take, sized from measured step times.

``Scheduler.max_prefill_tokens_with_decodes`` caps the prompt chunks of a step that runs
decodes, so the running requests' inter-token gap stays near a decode step's length while
a long prompt comes in (Sarathi-Serve sizes its chunks for a latency target the same way).
A fixed cap is right for one model, machine and context length only: a chunk token's cost
grows with the prompt's context (attention over every earlier position) and with the
number of rows the GEMMs already run. ``PrefillCap`` keeps the cap where a mixed step takes
about ``ratio`` times a decode-only step:

* decode-only steps give the baseline, an exponential average of their seconds. A decode
  step slows as its rows' contexts grow, so a baseline last measured many steps ago
  makes the prompt tokens look dear (the growth is put on them) and the cap falls to one
  token: while a long prompt is chunked there may be no decode-only step at all. So the
  engine asks for one (``wants_decode_only``) when there is no baseline yet or the last
  was ``refresh`` mixed steps ago, and the scheduler gives that step no prompt tokens.
  Such a step weighs 0.5 in the average (0.2 is too slow for samples ``refresh`` steps
  apart: the cap then settled at half its goal while decode steps slowed 0.5% a step);
* each mixed step gives the marginal cost of its prompt tokens, (mixed - baseline) / n,
  averaged the same way; the goal is the whole tokens that cost at most (ratio - 1) x
  baseline at that rate; the cap moves halfway down to a lower goal, and up to a higher
  one by half its value at the most (a step that ran fast by chance must not make the
  next step a long one);
* it starts at ``start`` tokens (default 1: until a mixed step has priced a prompt
  token, any larger chunk may be the step that stalls everyone; a long prompt arriving
  among decodes had taken 16 tokens at once, 2.35x a decode step) and stays within
  1 .. ``limit``; from 1 it climbs 2, 3, 4, 6, 9, ... while steps allow.

Steps without decodes (nothing to delay) and steps of other shapes are ignored.
"""
from __future__ import annotations

import math


class PrefillCap:
    def __init__(self, ratio: float, limit: int, start: int = 1, smoothing: float = 0.2, refresh: int = 8):
        if not ratio > 1.0 or not math.isfinite(ratio):
            raise ValueError(f"max_itl_ratio must be a number > 1 (a mixed step's time over a decode step's), got {ratio}")
        if limit < 1:
            raise ValueError(f"the prompt-token limit must be >= 1, got {limit}")
        if refresh < 1:
            raise ValueError(f"refresh (mixed steps between decode-only ones) must be >= 1, got {refresh}")
        self.refresh = int(refresh)
        self.mixed_since_baseline = 0
        self.ratio, self.limit, self.smoothing = float(ratio), int(limit), float(smoothing)
        self.cap = max(1, min(int(start), self.limit))
        self.decode_seconds: float | None = None   # the baseline, once a decode-only step was seen
        self.token_seconds: float | None = None    # a prompt token's cost in a mixed step (averaged)

    def wants_decode_only(self) -> bool:
        """Whether the next step that runs decodes should take no prompt tokens, to measure
        the baseline: none yet, or ``refresh`` mixed steps since the last."""
        return self.decode_seconds is None or self.mixed_since_baseline >= self.refresh

    def observe(self, seconds: float, decode_rows: int, prompt_tokens: int) -> int:
        """One step's time with its decode rows and prompt tokens; returns the cap for the
        next step."""
        if decode_rows == 0 or seconds <= 0:
            return self.cap
        if prompt_tokens == 0:
            d = self.decode_seconds
            weight = self.smoothing if self.mixed_since_baseline == 0 else max(self.smoothing, 0.5)
            self.decode_seconds = seconds if d is None else d + weight * (seconds - d)
            self.mixed_since_baseline = 0
            return self.cap
        base = self.decode_seconds
        if base is None:
            return self.cap
        self.mixed_since_baseline += 1
        cost = max(seconds - base, 1e-3 * base) / prompt_tokens
        c = self.token_seconds
        self.token_seconds = cost if c is None else c + self.smoothing * (cost - c)
        goal = max(1, min(self.limit, math.floor((self.ratio - 1.0) * base / self.token_seconds + 1e-9)))
        if goal < self.cap:   # halfway down, rounded towards the goal: it gets there
            self.cap = math.floor(0.5 * (self.cap + goal))
        else:                 # up by half at the most: one fast step must not make the next a long one
            self.cap = min(goal, max(self.cap + 1, math.floor(1.5 * self.cap)))
        return self.cap
