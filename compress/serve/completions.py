"""``POST /v1/completions``: prompts (text or token ids) to completions, whole or streamed.

Each prompt is ``n`` sequences in the engine and ``n`` choices in the answer (``index``
= the prompt's position times ``n`` plus the sample's, OpenAI's order). ``echo`` puts
the prompt in front of the text; with ``logprobs=k`` it also scores the prompt in one
cache-free forward before generating, so the answer's ``token_logprobs`` cover prompt
and completion (the prompt's first token: ``null``). That is what lm-eval's
``local-completions`` sends for loglikelihood tasks (``echo=true, logprobs=1,
max_tokens=1``; it reads the prompt's share). ``max_tokens=0`` with ``echo`` scores
without generating.

Context: a prompt must leave room for ``max_tokens`` in the model's context; a request
that names a ``max_tokens`` that does not fit is a 400 naming ``max_tokens``; the default
(16) shrinks to what fits.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from compress.serve.generation import ClientGone, Generation
from compress.serve.logprobs import TokenLogprob, completion_logprobs
from compress.serve.protocol import APIError, CompletionRequest
from compress.serve.sampling import check_logit_bias, sampling_params
from compress.serve.sse import SSE_DONE, GuardedStream, StopHoldback, sse_event


@dataclass
class _Choice:
    prompt_text: str
    prompt_ids: list[int]
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    text: str = ""
    finish_reason: str | None = None
    sample_index: int = 0     # which of the prompt's n choices (the first counts the prompt's usage)
    offset_base: int | None = None   # streaming: text_offset of token offset_counted
    offset_counted: int = 0
    prompt_offsets: list[int] | None = None   # echo: where each prompt token starts in prompt_text


def prepare(state, body: CompletionRequest) -> list[_Choice]:
    """Tokenize and check every prompt against the context."""
    choices = []
    ctx = state.max_seq_len
    many = len(body.prompt) > 1
    for i, prompt in enumerate(body.prompt):
        param = f"prompt.{i}" if many else "prompt"
        offsets = None
        if isinstance(prompt, str):
            if body.echo and body.logprobs is not None:   # the offsets from the same tokenization
                ids, offsets = state.encode_with_offsets(prompt, body.add_special_tokens, param)
            else:
                ids = state.encode(prompt, body.add_special_tokens, param)
            text = prompt
        else:
            state.check_token_ids(prompt, param)
            ids = list(prompt)
            text = state.decode(ids) if body.echo and state.tokenizer is not None else ""
        if not ids:
            raise APIError(f"{param}: the prompt is empty (no tokens)", param=param)
        if len(ids) > ctx or (len(ids) == ctx and body.max_tokens != 0):
            raise APIError(f"{param}: the prompt has {len(ids)} tokens; the model's context is {ctx} "
                           f"tokens and a completion needs at least one more", param=param,
                           code="context_length_exceeded")
        if "max_tokens" in body.model_fields_set and body.max_tokens is not None:
            max_tokens = body.max_tokens
            if len(ids) + max_tokens > ctx:
                raise APIError(f"max_tokens: {max_tokens} tokens after a prompt of {len(ids)} exceed the "
                               f"model's context of {ctx} tokens (at most {ctx - len(ids)})",
                               param="max_tokens", code="context_length_exceeded")
        else:
            max_tokens = min(16, ctx - len(ids))
        choices.extend(_Choice(text, ids, max_tokens, sample_index=j, prompt_offsets=offsets) for j in range(body.n))
    return choices


async def create_completion(state, body: CompletionRequest, request):
    """The JSON answer, or (``stream``) an async iterator of SSE lines."""
    state.check_model(body.model)
    check_logit_bias(state, body)
    choices = prepare(state, body)
    rid = f"cmpl-{uuid.uuid4().hex}"
    state.admit(len(choices))
    gen = Generation(state, rid, len(choices), request, watch_disconnect=True)
    try:
        if body.echo and body.logprobs is not None:   # each prompt scored once, for its n choices
            firsts = [i for i, c in enumerate(choices) if c.sample_index == 0]
            for i in firsts:
                gen.score(i, choices[i].prompt_ids, body.logprobs)
            for i, result in (await gen.scores(firsts)).items():
                for c in choices[i:i + body.n]:
                    c.prompt_logprobs = result.logprobs
        stops = body.stop_list()
        for i, c in enumerate(choices):
            if c.max_tokens > 0:
                gen.start(i, c.prompt_ids, sampling_params(body, c.max_tokens, stops, body.logprobs, c.sample_index,
                                          state.config.sampling_defaults),
                          body.logprobs)
            else:
                c.finish_reason = "length"
    except BaseException:
        gen.close()
        state.release(len(choices))
        raise
    if body.stream:
        return GuardedStream(_stream(state, body, rid, gen, choices, stops),
                             lambda: (gen.close(), state.release(len(choices))))
    try:
        while gen.running:
            index, item = await gen.next()
            _absorb(choices[index], item)
    finally:
        gen.close()
        state.release(len(choices))
    return _response(state, body, rid, choices)


def _absorb(choice: _Choice, item) -> None:
    choice.token_ids.extend(item.new_token_ids)
    choice.logprobs.extend(item.new_logprobs)
    choice.text = item.text
    if item.finished:
        choice.finish_reason = item.finish_reason or "length"


def _logprobs_of(state, body, c: _Choice, generated_from: int = 0, with_prompt: bool = True):
    """The choice's logprobs object: with the prompt's entries (``echo``) and the generated
    ones from ``generated_from`` on. Offsets count in the answer's text as a whole: a
    streamed chunk's tokens go on from where the chunks before it ended."""
    if body.logprobs is None:
        return None
    prompt = list(c.prompt_logprobs or []) if with_prompt and body.echo else []
    generated = c.logprobs[generated_from:]
    base = len(c.prompt_text) if c.offset_base is None else c.offset_base
    offset = base + sum(len(state.token_text(e.token_id)) for e in c.logprobs[c.offset_counted:generated_from])
    c.offset_counted, c.offset_base = generated_from, offset
    if not prompt:
        return completion_logprobs(generated, state.token_text, offset)
    # the echoed prompt's tokens where they start in its text (the tokenizer's offsets: a
    # BOS, or a SentencePiece leading space, takes no room there), then the generated ones
    # after the prompt text; else the tokens' texts back to back, as vLLM counts them
    obj = completion_logprobs(prompt + generated, state.token_text, 0)
    if c.prompt_offsets is not None and len(c.prompt_offsets) == len(prompt):
        after = completion_logprobs(generated, state.token_text, offset)["text_offset"]
        obj["text_offset"] = list(c.prompt_offsets) + after
    return obj


def _usage(choices: list[_Choice]) -> dict:
    prompt = sum(len(c.prompt_ids) for c in choices if c.sample_index == 0)
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _response(state, body, rid, choices) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": state.config.model_name,
            "choices": [{"index": i, "text": (c.prompt_text if body.echo else "") + c.text,
                         "logprobs": _logprobs_of(state, body, c),
                         "finish_reason": c.finish_reason or "length"} for i, c in enumerate(choices)],
            "usage": _usage(choices)}


async def _stream(state, body, rid, gen: Generation, choices, stops):
    created = int(time.time())

    def chunk(index, text, logprobs=None, finish_reason=None):
        return sse_event({"id": rid, "object": "text_completion", "created": created,
                          "model": state.config.model_name,
                          "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                       "finish_reason": finish_reason}]})

    holds = [StopHoldback(stops) for _ in choices]
    try:
        for i, c in enumerate(choices):
            if body.echo:
                yield chunk(i, c.prompt_text, _logprobs_of(state, body, c, with_prompt=True)
                            if c.prompt_logprobs is not None else None)
            if c.finish_reason is not None:    # max_tokens=0: nothing to generate
                yield chunk(i, "", None, c.finish_reason)
        while gen.running:
            index, item = await gen.next()
            c = choices[index]
            before = len(c.logprobs)
            _absorb(c, item)
            delta = holds[index].release(item.text, item.finished)
            lps = _logprobs_of(state, body, c, before, with_prompt=False)
            if delta or lps and lps["tokens"]:
                yield chunk(index, delta, lps)
            if item.finished:
                yield chunk(index, "", None, c.finish_reason)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse_event({"id": rid, "object": "text_completion", "created": created,
                             "model": state.config.model_name, "choices": [], "usage": _usage(choices)})
        yield SSE_DONE
    except ClientGone:
        return
    except asyncio.CancelledError:      # the response was cancelled: the client went away
        state.disconnected += 1
        raise
    except APIError as err:
        yield sse_event(err.body())
        yield SSE_DONE
