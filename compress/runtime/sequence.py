"""Per-request state: the tokens so far, the request's place in the engine (status,
computed tokens, KV block table), its incremental text and stop checks, its timings.

A sequence's tokens are ``prompt_ids + output_ids`` (``token_ids``). The engine computes
them into the KV cache in order: ``num_computed_tokens`` of them are there (prefix-cache
hits included); the rest are computed in later steps (a prompt, a prefill chunk, the
last sampled token). Preemption by recompute drops the blocks and sets
``num_computed_tokens`` back to 0; the tokens, the text and the sampling generator are
kept, so the request goes on where it stopped.
"""
from __future__ import annotations

import enum
import time
import weakref
from array import array
from dataclasses import dataclass, field

from compress.runtime.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued (new, or preempted): holds no KV blocks
    RUNNING = "running"      # admitted: holds KV blocks, computed a step at a time
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """The chosen token's log-probability under the model (before temperature / top-k /
    top-p) and the ``k`` most likely tokens' as ``{token_id: logprob}``."""
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """A request's state after a step, or its result. ``text`` and ``token_ids`` are
    everything generated so far; ``finish_reason``: 'stop' (eos, stop token or stop
    string), 'length' (max_tokens, the model's max_seq_len, or a KV cache too small for
    the sequence) or 'abort'; ``None`` while running. ``logprobs``: one entry per
    generated token when ``SamplingParams.logprobs`` is set (``prompt_token_ids`` is one
    list that a request's outputs share). ``metrics``: arrival,
    first-scheduled, first-token and finish times (``time.perf_counter`` seconds),
    ``prefill_s`` (first scheduled to first token), ``decode_s`` / ``decode_steps``
    (first token to finish, and the tokens after the first), prompt and cached tokens."""
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: dict = field(default_factory=dict)
    request_id: str = ""
    finished: bool = True
    logprobs: list[TokenLogprob] | None = None


def _decoder(tokenizer):
    """``ids -> text`` (special tokens skipped). A transformers fast tokenizer that neither
    overrides its decoding nor cleans up spaces decodes as its Rust backend does: call the
    backend directly, without transformers' Python layers (a quarter of the time; a decode
    step makes such a call per sequence, on caches the weights have just swept)."""
    from transformers import PreTrainedTokenizerFast  # here: the runtime imports no transformers eagerly

    backend = getattr(tokenizer, "backend_tokenizer", None)
    plain = (isinstance(tokenizer, PreTrainedTokenizerFast)
             and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
             and type(tokenizer).decode is PreTrainedTokenizerFast.decode)
    if backend is not None and plain and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


# tokenizer -> (the code of its _decoder, {token id: the token's text alone})
_SINGLE_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _remembering_decoder(tokenizer):
    """``_decoder(tokenizer)`` that remembers the text of single tokens, in one table per
    tokenizer that its sequences share (a vocabulary's entries at most; a new table when
    ``_decoder`` takes another path for it). In ``IncrementalDetokenizer``'s steady state
    one of a token's two windows is the token before it alone, so a decode step calls the
    tokenizer once a sequence instead of twice. Decoding is a function of the ids: the
    text is the same either way."""
    decode = _decoder(tokenizer)
    try:
        entry = _SINGLE_TOKENS.get(tokenizer)
        if entry is None or entry[0] is not decode.__code__:
            entry = _SINGLE_TOKENS[tokenizer] = (decode.__code__, {})
    except TypeError:   # a tokenizer that takes no weak reference
        entry = (decode.__code__, {})
    single = entry[1]

    def remembered(ids):
        if len(ids) != 1:
            return decode(ids)
        text = single.get(ids[0])
        if text is None:
            text = single[ids[0]] = decode(ids)
        return text
    return remembered


class IncrementalDetokenizer:
    """Text of generated tokens, decoded a few tokens at a time.

    Decodes the window ``tokens[prefix:]`` and releases what it adds beyond
    ``tokens[prefix:read]``; holds back while the tail is an incomplete UTF-8
    sequence. Seeding the window with the end of the prompt keeps tokenizers that
    drop a leading space right. The text of ``tokens[prefix:read]`` is decoded once per
    window (held back, the next token reuses it)."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.decode = _remembering_decoder(tokenizer)
        self.tokens = list(prompt_ids[-6:])
        self.prefix = 0
        self.read = len(self.tokens)
        self.before: str | None = None   # text of tokens[prefix:read], once decoded

    def add(self, token: int) -> str:
        self.tokens.append(token)
        before = self.before
        if before is None:
            before = self.before = self.decode(self.tokens[self.prefix:self.read])
        after = self.decode(self.tokens[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.tokens)
            self.before = None
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """The held-back tail, decoded as it is (U+FFFD for bytes that never completed a
        character), as ``tokenizer.decode`` gives it: the sequence ended, nothing more
        will complete it."""
        if self.read == len(self.tokens):
            return ""
        before = self.before if self.before is not None else self.decode(self.tokens[self.prefix:self.read])
        after = self.decode(self.tokens[self.prefix:])
        self.prefix, self.read, self.before = self.read, len(self.tokens), None
        return after[len(before):] if len(after) > len(before) else ""


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int], tokenizer=None, arrival_time: float | None = None):
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.prompt_ids = list(prompt_ids)
        self.token_ids = list(prompt_ids)  # prompt + output, the order the cache holds them
        self.output_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.status = SequenceStatus.WAITING
        # the engine's view
        self.num_computed_tokens = 0       # tokens whose K/V are in the cache
        self.num_cached_tokens = 0         # of the prompt, found in the prefix cache at first admission
        self.block_table = array("i")      # KV block of positions [i*block_size, (i+1)*block_size)
        self.block_hashes: list[int] = []  # prefix-cache hash of each full block of token_ids, in order
        self.num_registered_blocks = 0     # leading blocks of block_table the prefix cache knows
        self.num_preemptions = 0
        self.generator = params.make_generator()  # a seeded request's own draws
        self.plain_greedy = params.greedy and not params.modifies_logits   # the model's argmax is the token
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # times (time.perf_counter)
        self.arrival_time = time.perf_counter() if arrival_time is None else float(arrival_time)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # stops and text
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.detok = None if tokenizer is None else IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops = params.stop if self.detok is not None else []
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.released = 0
        self._prompt_ids_out: list[int] | None = None   # the prompt's ids as every output gives them

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, flush: bool = True) -> None:
        """``flush``: the text takes what the detokenizer held back (an unfinished
        character at a length cut or before a stop token); not after a stop string, whose
        cut already ended the text."""
        if self.finish_reason is None:
            if flush and self.detok is not None and reason != "abort":
                start = len(self.text)
                self.text += self.detok.flush()
                if self.stops and len(self.text) > start:
                    self._cut_at_stop(max(0, start - self.holdback))
            self.finish_reason = reason
            self.status = SequenceStatus.FINISHED
            self.finish_time = time.perf_counter()

    def append(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """A sampled token: extend the tokens and text, check the stops."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.token_ids.append(token)
        self.output_ids.append(token)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        if token in self.stop_ids:
            return self.finish("stop")
        if self.detok is not None:
            start = len(self.text)
            self.text += self.detok.add(token)
            if self.stops and len(self.text) > start:
                self._check_stop_strings(max(0, start - self.holdback))
        if len(self.output_ids) >= self.params.max_tokens:
            self.finish("length")

    def _cut_at_stop(self, search_from: int) -> bool:
        """Ends the text before the first stop string found from ``search_from``; whether one was."""
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)

    def _check_stop_strings(self, search_from: int) -> None:
        if self._cut_at_stop(search_from):
            self.finish("stop", flush=False)

    def take_delta(self) -> str:
        """Text not yet released; while running, the last characters that could start
        a stop string are held back."""
        end = len(self.text) if self.finished else max(self.released, len(self.text) - self.holdback)
        delta = self.text[self.released:end]
        self.released = end
        return delta

    def metrics(self) -> dict:
        m = {"arrival_time": self.arrival_time, "first_scheduled_time": self.first_scheduled_time,
             "first_token_time": self.first_token_time, "finish_time": self.finish_time,
             "prompt_tokens": len(self.prompt_ids), "cached_tokens": self.num_cached_tokens,
             "preemptions": self.num_preemptions}
        if self.first_token_time is not None and self.first_scheduled_time is not None:
            m["prefill_s"] = self.first_token_time - self.first_scheduled_time
        if self.finish_time is not None and self.first_token_time is not None:
            m["decode_s"] = self.finish_time - self.first_token_time
            m["decode_steps"] = max(len(self.output_ids) - 1, 0)
        return m

    def output(self) -> RequestOutput:
        """The request's state now. Its outputs share one copy of the prompt's ids (made on
        the first), so a step costs no copy of the prompt."""
        finished = self.finish_reason is not None
        text = self.text if finished or not self.holdback else self.text[:max(0, len(self.text) - self.holdback)]
        if self._prompt_ids_out is None:
            self._prompt_ids_out = list(self.prompt_ids)
        return RequestOutput(self.prompt, self._prompt_ids_out, text, self.output_ids[:], self.finish_reason,
                             self.metrics(), self.request_id, finished,
                             None if self.logprobs is None else self.logprobs[:])
