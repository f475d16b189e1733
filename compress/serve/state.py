"""What the HTTP side of the server holds: its settings, the model's tokenizer facts,
admission to the bounded queue, and the counters ``/metrics`` reports.

Admission counts sequences (one per prompt) that the server has handed the engine and
not yet seen finish. At most ``max_num_seqs`` of them run at once; the others wait, and
at most ``max_queue`` may wait: a request that would exceed that is answered 503 with
``Retry-After`` before the engine sees it. (A single request larger than the whole
bound is still admitted when nothing else is in flight, so that it can ever run.) All of
this lives on the event loop's thread: no locks.
"""
from __future__ import annotations

import copy
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from compress.serve.chat_template import PLAIN_CHAT_TEMPLATE, chat_template_of
from compress.serve.protocol import APIError, check_unicode
from compress.serve.token_bytes import token_bytes_fn


@dataclass
class ServeConfig:
    """Settings of ``compress serve`` that the HTTP layer reads."""
    model_name: str = "compress"
    api_key: str | None = None
    max_queue: int = 64                 # sequences allowed to wait beyond those running
    max_num_seqs: int = 16              # sequences the engine runs at once
    request_timeout: float | None = 600.0   # seconds from arrival to the last token
    retry_after_s: int = 1              # the Retry-After header of a 503
    disconnect_poll_s: float = 0.25     # how often a waiting non-streaming request checks its client
    sampling_defaults: dict = field(default_factory=dict)   # the model's generation_config sampling fields


@dataclass
class ServerState:
    config: ServeConfig
    llm: object
    engine_loop: object
    started: float = field(default_factory=time.time)
    in_flight: int = 0
    draining: bool = False
    requests: Counter = field(default_factory=Counter)      # (route, status) -> count
    rejected: int = 0
    timed_out: int = 0
    disconnected: int = 0

    def __post_init__(self):
        # the engine thread decodes with llm.tokenizer; the HTTP side gets its own copy
        # (a Rust tokenizer mutates its padding/truncation state inside calls)
        tok = self.llm.tokenizer
        try:
            self.tokenizer = copy.deepcopy(tok)
        except Exception:   # noqa: BLE001 - a tokenizer that cannot be copied is shared
            self.tokenizer = tok
        self.vocab_size = int(getattr(self.llm.config, "vocab_size", 0) or 0)
        self._token_bytes: dict[int, bytes] = {}
        self._bytes_of = None

    # ------------------------------------------------------------------ model facts
    @property
    def max_seq_len(self) -> int:
        return int(self.llm.max_seq_len)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise APIError(f"model: the model {name!r} does not exist; this server serves "
                           f"{self.config.model_name!r}", status=404, param="model",
                           code="model_not_found")

    def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        if self.tokenizer is None:
            raise APIError(f"{param}: this model has no tokenizer; send token ids", param=param)
        check_unicode(text, param)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_with_offsets(self, text: str, add_special_tokens: bool, param: str = "prompt"
                            ) -> tuple[list[int], list[int] | None]:
        """``encode``'s ids and where each starts in ``text`` (a fast tokenizer's offset
        mapping; a token it adds, as BOS, starts where the text is), or None for the
        offsets where the tokenizer gives none."""
        if self.tokenizer is None:
            raise APIError(f"{param}: this model has no tokenizer; send token ids", param=param)
        check_unicode(text, param)
        try:
            enc = self.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):   # a slow tokenizer: no offsets
            return self.encode(text, add_special_tokens, param), None
        starts, end = [], 0
        for a, b in enc["offset_mapping"]:
            starts.append(min(int(a), len(text)) if b > a else end)
            end = max(end, int(b))
        return list(enc["input_ids"]), starts

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer: cannot turn tokens into text")
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for (compress/serve/token_bytes.py): what a chat
        logprob's ``bytes`` holds, and, decoded, the token's text in both logprob layouts."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            if self.tokenizer is None:
                raw = str(token_id).encode()
            else:
                if self._bytes_of is None:
                    self._bytes_of = token_bytes_fn(self.tokenizer)
                raw = self._bytes_of(token_id)
            if len(self._token_bytes) < 1_000_000:
                self._token_bytes[token_id] = raw
        return raw

    def token_text(self, token_id: int) -> str:
        """The token's text: its bytes as UTF-8, U+FFFD for a part of a character."""
        return self.token_bytes(token_id).decode("utf-8", "replace")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if t < 0 or (self.vocab_size and t >= self.vocab_size)]
        if bad:
            raise APIError(f"{param}: token id {bad[0]} is outside the vocabulary "
                           f"(0..{self.vocab_size - 1})", param=param)

    def chat_template(self) -> str:
        return chat_template_of(self.tokenizer) or PLAIN_CHAT_TEMPLATE

    def tokenizer_info(self) -> dict:
        tok = self.tokenizer
        get = (lambda name: getattr(tok, name, None)) if tok is not None else (lambda name: None)
        return {"tokenizer_class": type(tok).__name__ if tok is not None else None,
                "bos_token": get("bos_token"), "eos_token": get("eos_token"),
                "pad_token": get("pad_token"), "unk_token": get("unk_token"),
                "bos_token_id": get("bos_token_id"), "eos_token_id": get("eos_token_id"),
                "chat_template": self.chat_template(), "model_max_length": self.max_seq_len,
                "vocab_size": self.vocab_size}

    # ------------------------------------------------------------------ admission
    def admit(self, sequences: int) -> None:
        if self.draining or not self.engine_loop.alive:
            raise APIError("the server is shutting down", status=503, type="server_error",
                           code="unavailable", headers={"Retry-After": str(self.config.retry_after_s)})
        bound = self.config.max_num_seqs + self.config.max_queue
        if self.in_flight and self.in_flight + sequences > bound:
            self.rejected += 1
            raise APIError(f"the queue is full ({self.in_flight} requests in flight, at most "
                           f"{self.config.max_queue} may wait); retry later", status=503,
                           type="server_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        self.in_flight += sequences

    def release(self, sequences: int) -> None:
        self.in_flight -= sequences


def default_model_name(path) -> str:
    return Path(str(path)).resolve().name or "compress"
