"""``POST /v1/chat/completions``: messages through the chat template, ``n`` replies.

The prompt is :func:`~compress.serve.chat_template.render_chat` of the messages, encoded
without adding special tokens (the template holds them). ``max_tokens`` (or
``max_completion_tokens``) defaults to the rest of the context. ``n`` replies are ``n``
sequences of the one prompt (choice ``index`` j; a seeded request's j-th draws from
seed + j). Streaming sends each choice's assistant role first, then content deltas, then
an empty delta with the finish reason, then (``stream_options.include_usage``) a chunk
with no choices and the usage.
"""
from __future__ import annotations

import asyncio
import time
import uuid

from compress.serve.chat_template import default_stops, render_chat
from compress.serve.generation import ClientGone, Generation
from compress.serve.logprobs import chat_logprobs
from compress.serve.protocol import APIError, ChatCompletionRequest
from compress.serve.sampling import check_logit_bias, sampling_params
from compress.serve.sse import SSE_DONE, GuardedStream, StopHoldback, sse_event


def chat_prompt_ids(state, messages: list[dict], add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None) -> list[int]:
    if state.tokenizer is None:
        raise APIError("messages: this model has no tokenizer, so it cannot chat", param="messages")
    try:
        text = render_chat(state.tokenizer, messages, add_generation_prompt, template_kwargs)
    except Exception as e:   # a template that raises (jinja's raise_exception, a bad variable)
        param = "chat_template_kwargs" if template_kwargs else "messages"
        raise APIError(f"{param}: the chat template failed: {e}", param=param) from None
    return state.encode(text, add_special_tokens=False, param="messages")


async def create_chat_completion(state, body: ChatCompletionRequest, request):
    state.check_model(body.model)
    check_logit_bias(state, body)
    ids = chat_prompt_ids(state, body.plain_messages(), body.add_generation_prompt, body.chat_template_kwargs)
    ctx = state.max_seq_len
    if len(ids) >= ctx:
        raise APIError(f"messages: the conversation has {len(ids)} tokens; the model's context is {ctx} "
                       f"tokens and a reply needs at least one more", param="messages",
                       code="context_length_exceeded")
    max_tokens = body.requested_max_tokens()
    if max_tokens is None:
        max_tokens = ctx - len(ids)
    elif len(ids) + max_tokens > ctx:
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise APIError(f"{name}: {max_tokens} tokens after a conversation of {len(ids)} exceed the "
                       f"model's context of {ctx} tokens (at most {ctx - len(ids)})", param=name,
                       code="context_length_exceeded")
    top = (body.top_logprobs or 0) if body.logprobs else None
    stops = body.stop_list() + default_stops(state.tokenizer)
    n = body.n
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    state.admit(n)
    gen = Generation(state, rid, n, request)
    try:
        for j in range(n):   # n samples of one conversation, n sequences
            gen.start(j, ids, sampling_params(body, max_tokens, stops, top, j, state.config.sampling_defaults), top)
    except BaseException:
        gen.close()
        state.release(n)
        raise
    if body.stream:
        return GuardedStream(_stream(state, body, rid, gen, len(ids), stops),
                             lambda: (gen.close(), state.release(n)))
    tokens, lps, texts, reasons = [0] * n, [[] for _ in range(n)], [""] * n, [None] * n
    try:
        while gen.running:
            j, item = await gen.next()
            tokens[j] += len(item.new_token_ids)
            lps[j].extend(item.new_logprobs)
            texts[j] = item.text
            if item.finished:
                reasons[j] = item.finish_reason or "length"
    finally:
        gen.close()
        state.release(n)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": state.config.model_name,
            "choices": [{"index": j, "message": {"role": "assistant", "content": texts[j]},
                         "logprobs": chat_logprobs(lps[j], state.token_bytes) if body.logprobs else None,
                         "finish_reason": reasons[j] or "length"} for j in range(n)],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": sum(tokens),
                      "total_tokens": len(ids) + sum(tokens)}}


async def _stream(state, body, rid, gen: Generation, prompt_tokens: int, stops: list[str]):
    created = int(time.time())

    def chunk(index: int, delta: dict, finish_reason=None, logprobs=None):
        return sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                          "model": state.config.model_name,
                          "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": finish_reason}]})

    holds = [StopHoldback(stops) for _ in range(body.n)]
    completion_tokens = 0
    try:
        for j in range(body.n):
            yield chunk(j, {"role": "assistant", "content": ""})
        while gen.running:
            j, item = await gen.next()
            completion_tokens += len(item.new_token_ids)
            delta = holds[j].release(item.text, item.finished)
            lps = chat_logprobs(item.new_logprobs, state.token_bytes) if body.logprobs else None
            if delta or (lps and lps["content"]):
                yield chunk(j, {"content": delta}, logprobs=lps)
            if item.finished:
                yield chunk(j, {}, item.finish_reason or "length")
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                             "model": state.config.model_name, "choices": [],
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                       "total_tokens": prompt_tokens + completion_tokens}})
        yield SSE_DONE
    except ClientGone:
        return
    except asyncio.CancelledError:      # the response was cancelled: the client went away
        state.disconnected += 1
        raise
    except APIError as err:
        yield sse_event(err.body())
        yield SSE_DONE
