"""Sampling parameters and the batched sampler (penalties, logit bias, greedy, temperature,
top-k, top-p), and the log-probabilities a request asks for.

Each request may carry its own seed: its draws then come from its own
``torch.Generator`` (held by its sequence), so its output does not depend on what else
is in the batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import compress.ops  # noqa: F401  (defines torch.ops.compress, argmax_rows among them)


@dataclass
class SamplingParams:
    """vLLM-shaped sampling parameters. ``temperature=0`` is greedy; ``top_k=0`` (or -1)
    and ``top_p=1`` disable those filters; ``stop`` holds strings that end a sequence
    (excluded from the text), ``stop_token_ids`` tokens that do. ``logprobs=k``: each
    generated token's log-probability under the model (before penalties, temperature and
    the filters) and the ``k`` most likely tokens' (``RequestOutput.logprobs``).

    Penalties (OpenAI's and vLLM's definitions; ``apply_penalties``), applied to the logits
    before everything else, greedy included: ``repetition_penalty`` (1 = off) divides the
    positive logits and multiplies the negative ones of every token already in the prompt
    or the output; ``frequency_penalty`` subtracts itself times the number of times a token
    was generated so far, ``presence_penalty`` itself once for any token generated (both
    in [-2, 2], 0 = off; negative values favour repeats). ``logit_bias`` (OpenAI's): token
    id -> a bias in [-100, 100] added to that token's logit after the penalties (-100 bans
    the token in effect, 100 all but forces it)."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None

    def __post_init__(self):
        if self.max_tokens is None or int(self.max_tokens) < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logprobs is not None and int(self.logprobs) < 0:
            raise ValueError(f"SamplingParams.logprobs must be None or >= 0, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        bias = {}
        for token, value in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"SamplingParams.logit_bias: token ids must be ints >= 0, got {token!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
                raise ValueError(f"SamplingParams.logit_bias[{token}] must be a number in [-100, 100], got {value!r}")
            if value != 0:
                bias[token] = float(value)
        self.logit_bias = bias or None

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the logits then depend on the tokens so far)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def modifies_logits(self) -> bool:
        """Whether penalties or a logit bias change the model's logits before sampling
        (greedy then takes the argmax of the changed ones, not the model's)."""
        return self.penalized or self.logit_bias is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device="cpu") -> torch.Generator | None:
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(int(self.seed))
        return g


class BatchSampler:
    """Per-row parameters of a batch held as tensors, so one step samples the whole
    batch with a handful of vectorized ops. ``generators``: each row's own generator
    (a seeded request's), ``None`` for rows that draw from torch's global one."""

    def __init__(self, params: list[SamplingParams], generators: list[torch.Generator | None] | None = None,
                 device="cpu"):
        self.device = torch.device(device)
        self.params = list(params)
        self.generators = (list(generators) if generators is not None
                           else [p.make_generator(self.device) for p in params])
        self.all_greedy = all(p.greedy for p in params)
        self.temperature = torch.tensor([p.temperature for p in params], device=self.device)
        self.top_k = torch.tensor([p.top_k if p.top_k > 0 else 0 for p in params], device=self.device)
        self.top_p = torch.tensor([p.top_p for p in params], device=self.device)
        self.need_filter = any((p.top_k > 0 or p.top_p < 1.0) and not p.greedy for p in params)
        self.penalized = [p.penalized for p in params]
        self.needs_history = any(self.penalized)   # __call__ then needs each row's tokens so far
        if self.needs_history:
            self.presence = torch.tensor([p.presence_penalty for p in params], device=self.device)
            self.frequency = torch.tensor([p.frequency_penalty for p in params], device=self.device)
            self.repetition = torch.tensor([p.repetition_penalty for p in params], device=self.device)
        # logit_bias as (rows, token ids, biases): one index_put_ a step
        entries = [(r, t, b) for r, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        self.bias, self.bias_top_token = None, -1
        if entries:
            rows, tokens, values = zip(*entries)
            self.bias = (torch.tensor(rows, device=self.device), torch.tensor(tokens, device=self.device),
                         torch.tensor(values, device=self.device))
            self.bias_top_token = max(tokens)   # checked against the vocabulary per call, no device sync

    def __call__(self, logits: torch.Tensor,
                 histories: list[tuple[list[int], list[int]]] | None = None) -> torch.Tensor:
        """One token per row of ``logits``; ``histories``: each row's (prompt ids, output ids
        so far), needed when a row has a penalty."""
        if self.needs_history:
            if histories is None or len(histories) != len(self.params):
                raise ValueError("a penalized batch needs each row's (prompt ids, output ids)")
            counts, seen = token_counts(histories, self.penalized, logits.shape[-1], logits.device)
            logits = apply_penalties(logits, counts, seen, self.presence, self.frequency, self.repetition)
        if self.bias is not None:
            if self.bias_top_token >= logits.shape[-1]:
                raise ValueError(f"logit_bias names token {self.bias_top_token}, outside the vocabulary of "
                                 f"{logits.shape[-1]}")
            logits = add_logit_bias(logits, *self.bias)
        return sample(logits, self.temperature, self.top_k, self.top_p, self.generators,
                      all_greedy=self.all_greedy, need_filter=self.need_filter)


def token_counts(histories: list[tuple[list[int], list[int]]], rows: list[bool], vocab: int,
                 device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """For the ``rows`` that are True: how many times each token id is in the output
    (float ``[B, V]``) and whether it is in the prompt or the output (bool ``[B, V]``);
    zeros and False for the other rows."""
    counts = torch.zeros((len(histories), vocab), device=device)
    seen = torch.zeros((len(histories), vocab), dtype=torch.bool, device=device)
    for r, ((prompt, output), on) in enumerate(zip(histories, rows)):
        if not on:
            continue
        if output:
            out = torch.as_tensor(output, dtype=torch.int64, device=device)
            counts[r].index_add_(0, out, torch.ones(len(output), device=device))
            seen[r, out] = True
        if prompt:
            seen[r, torch.as_tensor(prompt, dtype=torch.int64, device=device)] = True
    return counts, seen


def add_logit_bias(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                   values: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` with ``values[i]`` added at ``(rows[i], tokens[i])`` (a new tensor;
    the other entries keep their bits)."""
    return logits.index_put((rows, tokens), values.to(logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` with each row's penalties (``[B]`` each): the seen tokens'
    positive logits divided by ``repetition`` and negative ones multiplied by it, then
    ``frequency * count + presence * (count > 0)`` subtracted (``token_counts``). A row
    with no penalty (0, 0, 1) keeps its logits bit for bit."""
    rep = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p nucleus.
    ``top_k`` 0 = no limit; the nucleus is the smallest set of most likely tokens whose
    probability reaches ``top_p`` (always at least one token)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def row_uniforms(generators: list[torch.Generator | None], device) -> torch.Tensor:
    """One U[0, 1) float64 draw per row: a seeded row's from its own generator (so it
    does not depend on its batch), the others from torch's global one."""
    u = torch.empty(len(generators), dtype=torch.float64)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g, dtype=torch.float64, device=g.device).item()
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    return u.to(device)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of ``weights [B, C]`` (non-negative, not necessarily
    normalised; its kept entries first) by the inverse of its cumulative sum at ``u [B]``
    in [0, 1): the first index whose running sum exceeds u times the row's total, so
    never a zero-weight index (where rounding puts u times the total at the total, the
    last positive one). The sum is fp32, as FlashInfer's sampling kernels keep theirs: a
    token under ~1e-7 of the mass behind it is not drawn (float64 had cost 2x at 16 rows
    of 32,000)."""
    cum = weights.cumsum(dim=-1)
    target = (u.double() * cum[:, -1].double()).to(cum.dtype).unsqueeze(1)
    idx = torch.searchsorted(cum, target, right=True).squeeze(1)
    last = weights.shape[1] - 1 - (weights > 0).flip(-1).to(torch.uint8).argmax(dim=-1)
    return torch.minimum(idx, last)


# exp of log-probabilities at most this far below a row's maximum is taken as exp of this
# (~2e-35 of the maximum's): further down the fp32 results are subnormal, which ran ~30x
# slower on the CPU (16 rows of 32,000 logits spanning +-80: logsumexp 5.3 ms against 0.17
# for +-4). What it adds to a row's mass is under 1e-30 of it.
EXP_FLOOR = -80.0


def exp_floored(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for x <= 0 (a difference from a row's maximum), with x under EXP_FLOOR taken
    as EXP_FLOOR and -inf still 0."""
    return x.clamp(min=EXP_FLOOR).exp().masked_fill_(x == float("-inf"), 0.0)


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` log of each row's sum of exp (a row holds a finite value), through exp_floored."""
    m = x.amax(dim=-1, keepdim=True)
    return m + exp_floored(x - m).sum(dim=-1, keepdim=True).log()


# Candidates a filtered row starts from (its top_k when that is smaller), and the least
# factor they grow by while some row's set does not fit (past a quarter of the vocabulary,
# a sort of the whole row instead: topk is then about as dear).
NUCLEUS_START = 64
NUCLEUS_GROWTH = 8
# Below this many tokens a row's sort costs less than the candidates' extra small ops.
NUCLEUS_MIN_VOCAB = 16384
# Temperatures under this are greedy (dividing by them overflows the logits).
MIN_TEMPERATURE = 1e-5


def canonical_order(vals: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vals, ids)`` reordered by value descending, then token id ascending: the one order
    of a row's tokens whichever way they were found (topk and sort order ties as they like),
    so a row's kept set and draw do not depend on how many candidates its batch took."""
    by_id, perm = ids.sort(dim=-1)
    vals = vals.gather(1, perm)
    vals, order = vals.sort(dim=-1, descending=True, stable=True)
    return vals, by_id.gather(1, order)


def kept_set(vals: torch.Tensor, ks: torch.Tensor, k_rows: torch.Tensor, top_p: torch.Tensor,
             row_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From a row's largest logits in canonical order (``vals [B, C]``): ``(kept, drop)``,
    the logits of its top-k / top-p set (-inf past it) and the nucleus cut. filter_logits'
    rule: ranks >= k out (``k_rows``), probabilities over the k tokens or else over the
    whole row (``row_lse``), then out every token whose mass before it reaches top_p. The
    k tokens' total is read off a running sum, which only the prefix decides, so the
    candidates and the sort give a row the same bits."""
    C = vals.shape[1]
    ranks = torch.arange(C, device=vals.device).unsqueeze(0)
    masked = vals.masked_fill(ranks >= ks.unsqueeze(1), float("-inf"))
    top = vals[:, :1]
    k_total = exp_floored(masked - top).cumsum(dim=-1).gather(1, (ks.clamp(max=C) - 1).unsqueeze(1))
    lse = torch.where((k_rows & (ks <= C)).unsqueeze(1), top + k_total.log(), row_lse)
    probs = exp_floored(masked - lse)
    drop = ((probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    return masked.masked_fill(drop, float("-inf")), drop


def k_limits(top_k: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_rows, ks)``: the rows whose top_k cuts (0 < k < V; k >= V keeps every token)
    and each row's k (V where it does not cut)."""
    k_rows = (top_k > 0) & (top_k < vocab)
    return k_rows, torch.where(k_rows, top_k, vocab)


def nucleus_candidates(scaled: torch.Tensor, k_rows: torch.Tensor, ks: torch.Tensor, top_p: torch.Tensor,
                       row_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's top-k / top-p set as filter_logits keeps it, without sorting the whole
    vocabulary: ``(kept [B, C], ids [B, C])`` in canonical order, -inf past the set. From
    the row's C largest logits (``topk``, C from 64, growing) through kept_set; ``k_rows``
    / ``ks`` from k_limits, ``row_lse`` each row's logsumexp_rows. A row is
    settled once its k tokens are all candidates (top_k > 0) or its nucleus ended before
    them, and the tie group at its cut ended before the last candidate too (tokens that
    tie with it may lie outside). None when C would have to pass a quarter of the
    vocabulary (a flat row), the vocabulary is under NUCLEUS_MIN_VOCAB, or a row's mass
    is not finite: a sort of the row is then the way (sample())."""
    B, V = scaled.shape
    need = int(ks.max())
    c = need + 1 if bool((top_p >= 1.0).all()) else max(min(need + 1, NUCLEUS_START), 2)
    if c > V // 4 or V < NUCLEUS_MIN_VOCAB or not bool(row_lse.isfinite().all()):
        return None
    while True:
        vals, ids = canonical_order(*scaled.topk(c, dim=-1))
        kept, drop = kept_set(vals, ks, k_rows, top_p, row_lse)
        n_kept = kept.isfinite().sum(dim=-1)
        last_kept = vals.gather(1, (n_kept - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        tie_inside = vals[:, -1] < last_kept   # every token tied with the last kept one is a candidate
        cut = torch.where(k_rows, ks < c, (top_p < 1.0) & drop.any(dim=-1))
        done = cut & tie_inside
        if bool(done.all()):
            return kept, ids
        covered = exp_floored(vals - row_lse).sum(dim=-1).clamp(min=1e-30)
        short = float((top_p / covered)[~done].max())
        if not math.isfinite(short):
            return None
        grow = max(NUCLEUS_GROWTH, math.ceil(2 * short))
        open_k = ~done & k_rows   # a top_k row's k tokens and one more, to see past its cut
        c = max(int(c * grow), int(ks[open_k].max()) + 1 if bool(open_k.any()) else 0)
        if c > V // 4:
            return None


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           generators: list[torch.Generator | None], all_greedy: bool = False,
           need_filter: bool = True) -> torch.Tensor:
    """One token per row of fp32 ``logits [B, V]``: greedy where the temperature is under
    MIN_TEMPERATURE or the row holds a NaN or an infinity, else a draw from
    softmax(logits / temperature) restricted to the row's top-k / top-p set, by the
    inverse of the cumulative distribution at one uniform per row (``row_uniforms``), not
    one random number per token. A row's set comes in canonical order from its candidates
    (``nucleus_candidates``), or where those would be a quarter of the vocabulary or it is
    small, from one sort of its row: the same set and draw either way."""
    greedy_tokens = torch.ops.compress.argmax_rows(logits)
    if all_greedy:
        return greedy_tokens
    greedy = (temperature < MIN_TEMPERATURE) | ~logits.isfinite().all(dim=-1)
    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    u = row_uniforms(generators, logits.device)
    sampled = greedy_tokens.clone()
    filtered = ((top_k > 0) | (top_p < 1.0)) & ~greedy if need_filter else torch.zeros_like(greedy)
    rows_f = filtered.nonzero().squeeze(1)
    rows_a = (~filtered & ~greedy).nonzero().squeeze(1)
    if rows_f.numel():
        rows, p = scaled[rows_f], top_p[rows_f]
        k_rows, ks = k_limits(top_k[rows_f], rows.shape[1])
        row_lse = logsumexp_rows(rows)   # the normaliser of rows without a k, either way
        candidates = nucleus_candidates(rows, k_rows, ks, p, row_lse)
        if candidates is None:   # one sort of each row
            vals, ids = rows.sort(dim=-1, descending=True, stable=True)   # ties by id: the canonical order
            kept, _ = kept_set(vals, ks, k_rows, p, row_lse)
        else:
            kept, ids = candidates
        weights = exp_floored(kept - kept[:, :1])   # the kept tokens' relative weights (0 past them)
        sampled[rows_f] = ids.gather(1, inverse_cdf(weights, u[rows_f]).unsqueeze(1)).squeeze(1)
    if rows_a.numel():
        rows = scaled[rows_a]
        sampled[rows_a] = inverse_cdf(exp_floored(rows - rows.amax(dim=-1, keepdim=True)), u[rows_a])
    return torch.where(greedy, greedy_tokens, sampled)


def token_logprobs_topk(logits: torch.Tensor, tokens: list[int], k: list[int]) -> list[tuple[float, dict[int, float]]]:
    """For fp32 ``logits [R, V]`` and each row's chosen token: ``(log p(token), {id: log p}
    of the row's k most likely tokens)``, under the model's distribution (log-softmax of
    the raw logits)."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(-1, torch.as_tensor(tokens, device=lp.device).view(-1, 1)).view(-1).tolist()
    kmax = max(k, default=0)
    top_vals = top_ids = None
    if kmax > 0:
        top_vals, top_ids = lp.topk(min(kmax, lp.shape[-1]), dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out = []
    for r, (c, kr) in enumerate(zip(chosen, k)):
        top = {} if not kr else dict(zip(top_ids[r][:kr], top_vals[r][:kr]))
        out.append((c, top))
    return out
