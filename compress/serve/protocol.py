"""The OpenAI HTTP API's request bodies, validated, and its error body.

Every request body is parsed here: malformed JSON, an unknown field, a value of the
wrong type or out of range becomes an :class:`APIError` (HTTP 400) whose body is
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with ``param`` naming the
field (``messages.1.content`` for nested ones). Models are strict (no string to number
coercion) and forbid unknown fields. Fields OpenAI defines that the runtime does not
implement are accepted only at their neutral value (``tools=[]``,
``response_format={"type": "text"}``, ...), so a client that asks for them is told, not
ignored. ``null`` for an optional field means its default, as in OpenAI's API (clients
that build bodies from dicts send unset fields so).
"""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_LOGPROBS = 20      # top alternatives per token (vLLM's default bound; OpenAI's is 5)
MAX_N = 128            # choices a request may ask for (OpenAI's bound)
# what the server passes to the chat template itself: not for chat_template_kwargs
RENDER_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "tokenize", "bos_token", "tools",
                              "documents", "return_dict", "conversation", "chat_template"})

# OpenAI's fields that the runtime does not implement: field -> (its neutral values, what a
# 400 says otherwise). A request may send them only where they ask for nothing.
NEUTRAL_ONLY: dict[str, tuple[tuple, str]] = {
    "response_format": ((None, {"type": "text"}), 'only {"type": "text"} is supported (no JSON mode or schema)'),
    "tools": ((None, []), "tools are not supported (no function calling)"),
    "tool_choice": ((None, "none", "auto"), 'only "none" or "auto" without tools is supported'),
    "store": ((False,), "stored completions are not supported (only false)"),
    "service_tier": ((None, "auto", "default"), 'only "auto" or "default"'),
}
COMPLETION_NEUTRAL_ONLY = NEUTRAL_ONLY | {
    "best_of": ((None, 1), "only best_of=1 is supported"),
    "suffix": ((None, ""), "suffix is not supported"),
}


class APIError(Exception):
    """An error answered as OpenAI does: HTTP ``status`` and ``{"error": {...}}``."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


def template_variables(v: dict | None) -> dict | None:
    """``chat_template_kwargs``, refused where it names what the server sets itself."""
    taken = sorted(set(v or {}) & RENDER_ARGUMENTS)
    if taken:
        raise ValueError(f"{', '.join(taken)}: set by the server, not a template variable")
    return v


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)   # vLLM's range; negative seeds wrap
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # OpenAI's fields for what a text model without tools does anyway: their neutral values only
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool | None = None
    store: bool = False
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's extensions the runtime supports
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float = Field(1.0, gt=0.0)

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, v):
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids as strings (as \"50256\"), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {bias}")
        return v

    def logit_bias_by_id(self) -> dict[int, float]:
        return {int(k): float(b) for k, b in (self.logit_bias or {}).items()}

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    neutral_only: ClassVar[dict[str, tuple[tuple, str]]] = NEUTRAL_ONLY

    @model_validator(mode="after")
    def _neutral_values_only(self):
        for name, (neutral, why) in self.neutral_only.items():
            value = getattr(self, name)
            if value not in neutral:
                raise ValueError(f"{name}: {why} (got {value!r})")
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a list of
    either (one choice per prompt). ``max_tokens=0`` is allowed only with ``echo``
    (score the prompt, generate nothing: what lm-eval's loglikelihood asks for)."""
    prompt: Any
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    neutral_only: ClassVar[dict[str, tuple[tuple, str]]] = COMPLETION_NEUTRAL_ONLY

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v):
        return normalize_prompts(v)

    @model_validator(mode="after")
    def _zero_tokens_needs_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be at least 1 (0 only with echo)")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # what a client sends back of an earlier assistant message (the SDKs' message objects)
    refusal: str | None = None
    annotations: list | None = None
    tool_calls: list | None = None

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, v):
        if v:
            raise ValueError("tool calls are not supported (no function calling)")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` is OpenAI's newer name of
    ``max_tokens`` (give one); ``logprobs`` is a flag and ``top_logprobs`` the count."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # vLLM's extension: extra variables for the chat template (Qwen3's enable_thinking, ...)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, v):
        return template_variables(v)

    @model_validator(mode="after")
    def _one_max(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_completion_tokens: give max_tokens or max_completion_tokens, not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def plain_messages(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` or chat ``messages``."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, v):
        return template_variables(v)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def normalize_prompts(value) -> list[str | list[int]]:
    """A completions ``prompt`` as a list of prompts, each a string or a list of ints."""
    def is_ids(x):
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and is_ids(value):
        return [list(value)]
    if isinstance(value, list) and value and all(isinstance(p, str) or (is_ids(p) and p) for p in value):
        return [p if isinstance(p, str) else list(p) for p in value]
    raise ValueError("must be a string, a non-empty list of token ids, or a non-empty list of those")


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object; 400 otherwise (NaN and Infinity are not JSON)."""
    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        data = json.loads(raw, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(f"malformed JSON body: {exc}", param=None, code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    _check_strings(data, [])
    return data


def check_unicode(text: str, param: str | None) -> None:
    """400 for a string that is not valid Unicode: JSON's ``\\ud83d`` escape can carry half
    of a UTF-16 surrogate pair (a JavaScript client that cut an emoji in two sends one), which
    no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"{param}: " if param else ""
        raise APIError(f"{where}the text holds an unpaired UTF-16 surrogate (U+{ord(text[exc.start]):04X}) at "
                       f"character {exc.start}: not valid Unicode", param=param) from None


def _check_strings(value, path: list) -> None:
    """Every string of a parsed body (keys too) through :func:`check_unicode`, naming its path."""
    if isinstance(value, str):
        check_unicode(value, ".".join(map(str, path)) or None)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_unicode(k, ".".join(map(str, path + [k])) or None)
            _check_strings(v, path + [k])
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, (str, dict, list)):
                _check_strings(v, path + [i])


def validate(model_class: type[BaseModel], data: dict) -> BaseModel:
    """``model_class(**data)`` or an :class:`APIError` naming the first bad field."""
    try:
        return model_class.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_error(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    raw_loc = err.get("loc", ())
    # pydantic puts the member of a union it tried into the location ('str', 'list[int]')
    loc = [str(p) for p in raw_loc if isinstance(p, int) or (
        isinstance(p, str) and p.isidentifier() and p not in _TYPE_TAGS)]
    param = ".".join(loc) or None
    message = err.get("msg", "invalid value")
    if len(loc) < len(raw_loc):
        message = "has the wrong type or value"
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if err.get("type") == "extra_forbidden":
        message = "unknown field"
    named, _, rest = message.partition(": ")
    if rest and named.isidentifier() and param is None:   # model-level checks name their field
        param, message = named, rest
    elif rest and named == param:
        message = rest
    if param and err.get("type") != "extra_forbidden" and "input" in err and not isinstance(
            err["input"], (dict, list)):
        message = f"{message} (got {err['input']!r})"
    return APIError(f"{param}: {message}" if param else message, param=param,
                    code="invalid_value" if param else "invalid_request")
