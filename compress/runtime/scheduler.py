"""Per-request state (tokens, incremental text, stop checks) and the batch planner.

v0 batching is static: requests are grouped into batches of at most
``max_batch_size`` (similar prompt lengths together, to waste little padding); a
batch runs until all of its sequences finish, finished rows leaving the batch as
they go.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from compress.runtime.sampling import SamplingParams


@dataclass
class RequestOutput:
    """One finished request. ``finish_reason``: 'stop' (eos, stop token or stop
    string) or 'length' (max_tokens or the model's max_seq_len)."""
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: dict = field(default_factory=dict)


def _decoder(tokenizer):
    """``ids -> text`` (special tokens skipped). A transformers fast tokenizer that neither
    overrides its decoding nor cleans up spaces decodes as its Rust backend does: call the
    backend directly, without transformers' Python layers (a quarter of the time; a decode
    step makes two such calls per sequence, on caches the weights have just swept)."""
    from transformers import PreTrainedTokenizerFast  # here: the runtime imports no transformers eagerly

    backend = getattr(tokenizer, "backend_tokenizer", None)
    plain = (isinstance(tokenizer, PreTrainedTokenizerFast)
             and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
             and type(tokenizer).decode is PreTrainedTokenizerFast.decode)
    if backend is not None and plain and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Text of generated tokens, decoded a few tokens at a time.

    Decodes the window ``tokens[prefix:]`` and releases what it adds beyond
    ``tokens[prefix:read]``; holds back while the tail is an incomplete UTF-8
    sequence. Seeding the window with the end of the prompt keeps tokenizers that
    drop a leading space right."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.decode = _decoder(tokenizer)
        self.tokens = list(prompt_ids[-6:])
        self.prefix = 0
        self.read = len(self.tokens)

    def add(self, token: int) -> str:
        self.tokens.append(token)
        before = self.decode(self.tokens[self.prefix:self.read])
        after = self.decode(self.tokens[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.tokens)
            return after[len(before):]
        return ""


class Sequence:
    def __init__(self, index: int, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int], tokenizer=None):
        self.index, self.prompt, self.prompt_ids, self.params = index, prompt, prompt_ids, params
        self.output_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.detok = None if tokenizer is None else IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops = params.stop if self.detok is not None else []
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.released = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason

    def append(self, token: int) -> None:
        self.output_ids.append(token)
        if token in self.stop_ids:
            return self.finish("stop")
        if self.detok is not None:
            start = len(self.text)
            self.text += self.detok.add(token)
            if self.stops and len(self.text) > start:
                self._check_stop_strings(max(0, start - self.holdback))
        if len(self.output_ids) >= self.params.max_tokens:
            self.finish("length")

    def _check_stop_strings(self, search_from: int) -> None:
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.finish("stop")

    def take_delta(self) -> str:
        """Text not yet released; while running, the last characters that could start
        a stop string are held back."""
        end = len(self.text) if self.finished else max(self.released, len(self.text) - self.holdback)
        delta = self.text[self.released:end]
        self.released = end
        return delta

    def output(self, metrics: dict | None = None) -> RequestOutput:
        return RequestOutput(self.prompt, list(self.prompt_ids), self.text, list(self.output_ids),
                             self.finish_reason or "length", dict(metrics or {}))


class Scheduler:
    def __init__(self, max_batch_size: int = 32):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.max_batch_size = max_batch_size

    def batches(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        ordered = sorted(seqs, key=lambda s: len(s.prompt_ids))
        n = self.max_batch_size
        return [ordered[i:i + n] for i in range(0, len(ordered), n)]
