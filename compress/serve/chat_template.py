"""Chat messages to prompt text: the tokenizer's own chat template, or a plain one.

A checkpoint whose tokenizer carries a ``chat_template`` is rendered with it (as
transformers and vLLM do). One without (a base model such as the embedded
pydoc-llama) gets :data:`PLAIN_CHAT_TEMPLATE`: the BOS token, then one line per message
``role: content``, then ``assistant:`` when a reply is wanted::

    <s>system: You are terse.
    user: Name a sorting function.
    assistant:

With the plain template a reply also stops at the start of a new turn
(:data:`PLAIN_TEMPLATE_STOPS`), since a base model would otherwise write both sides.
The rendered text already holds its special tokens, so it is encoded without adding
more (``add_special_tokens=False``), as vLLM does.
"""
from __future__ import annotations

from functools import lru_cache

PLAIN_CHAT_TEMPLATE = (
    "{% if bos_token is defined %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PLAIN_TEMPLATE_STOPS = ["\nuser:", "\nsystem:", "\ndeveloper:"]


def chat_template_of(tokenizer) -> str | None:
    """The tokenizer's own template (``None`` when it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) and template else None


@lru_cache(maxsize=4)
def _compiled(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
    return env.from_string(template)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                template_kwargs: dict | None = None) -> str:
    """Prompt text of ``messages`` (``[{"role", "content"}]``, content a string);
    ``template_kwargs``: extra template variables (Qwen3's ``enable_thinking``), as
    ``apply_chat_template`` takes them."""
    extra = dict(template_kwargs or {})
    if chat_template_of(tokenizer) is not None:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **extra)
    bos = getattr(tokenizer, "bos_token", None) or ""
    return _compiled(PLAIN_CHAT_TEMPLATE).render(**extra, messages=messages, bos_token=bos,
                                                 add_generation_prompt=add_generation_prompt)


def default_stops(tokenizer) -> list[str]:
    """Stop strings a chat reply gets besides the request's own."""
    return [] if chat_template_of(tokenizer) is not None else list(PLAIN_TEMPLATE_STOPS)
