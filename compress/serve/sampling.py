"""A request's sampling fields as the runtime's ``SamplingParams``.

OpenAI's ``top_k`` has no such field; ``-1`` (vLLM's "off") and ``0`` both mean no limit.
``temperature=0`` is greedy. ``temperature``, ``top_p``, ``top_k`` and ``repetition_penalty``
that a request leaves out come from the model's generation_config.json when it sets them
(``compress serve --generation-config auto``, the default, as vLLM's), else OpenAI's defaults.
``presence_penalty`` / ``frequency_penalty`` (OpenAI's) and
``repetition_penalty`` (vLLM's extension) become the runtime's penalties, ``logit_bias``
(token id strings -> [-100, 100]) its logit bias. ``logprobs=k``
asks the engine for each generated token's logprob and its ``k`` most likely alternatives.
``n`` choices of one prompt are ``n`` sequences in the engine.
"""
from __future__ import annotations

from compress.runtime import SamplingParams


def sampling_params(body, max_tokens: int, stops: list[str], logprobs: int | None,
                    sample_index: int = 0, defaults: dict | None = None) -> SamplingParams:
    """``sample_index``: which of the request's ``n`` choices (a seeded request's choice j
    draws from seed + j, as vLLM's, so the n samples differ and each is reproducible).
    ``defaults``: the model's generation_config sampling fields
    (``compress.runtime.engine.sampling_defaults``), for those the request does not name."""
    defaults = defaults or {}

    def field(name):
        return getattr(body, name) if name in body.model_fields_set or name not in defaults else defaults[name]

    seed = None if body.seed is None else (body.seed + sample_index) % 2**63
    kwargs = dict(max_tokens=max_tokens, temperature=float(field("temperature")), top_k=max(0, int(field("top_k"))),
                  top_p=float(field("top_p")), seed=seed, stop=list(stops),
                  stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
                  presence_penalty=float(body.presence_penalty), frequency_penalty=float(body.frequency_penalty),
                  repetition_penalty=float(field("repetition_penalty")), logit_bias=body.logit_bias_by_id())
    if logprobs is not None:
        kwargs["logprobs"] = int(logprobs)
    return SamplingParams(**kwargs)


def check_logit_bias(state, body) -> None:
    """A 400 naming ``logit_bias`` where it names a token outside the model's vocabulary."""
    state.check_token_ids(sorted(body.logit_bias_by_id()), "logit_bias")
