"""compress serve over HTTP: the openai client, streaming, seeds, logprobs, tokenizer
routes, validation, API key, the bounded queue, timeouts, disconnects, metrics."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests

from conftest import MODEL_NAME, client


def wait_idle(server, timeout=10.0) -> dict:
    """The engine's counters once nothing is in flight."""
    deadline = time.monotonic() + timeout
    while True:
        stats = dict(server.state.engine_loop.stats)
        if server.state.in_flight == 0 and stats.get("running") == 0 and stats.get("waiting") == 0:
            return stats
        assert time.monotonic() < deadline, f"not idle: in flight {server.state.in_flight}, {stats}"
        time.sleep(0.02)


# ---------------------------------------------------------------- the openai client
def test_completions_greedy_equal_the_runtime(server, references):
    c = client(server)
    for prompt, text, ids in zip(references["prompts"], references["texts"], references["token_ids"]):
        out = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == text
        assert out.usage.completion_tokens == len(ids)
    # several prompts in one request, as token ids and text
    ids = server.state.encode(references["prompts"][1], True)
    out = c.completions.create(model=MODEL_NAME, prompt=[ids, references["prompts"][0]], max_tokens=12,
                               temperature=0)
    assert [ch.text for ch in sorted(out.choices, key=lambda ch: ch.index)] == references["texts"][::-1]


def test_the_served_llm_refuses_direct_generation(server, embedded_llm):
    """While a server's engine thread runs the LLM, generate / stream / scoring from another
    thread would race its steps (and its scoring) on the one engine and model runner: they
    raise, naming the thread and what to do instead, and the server goes on serving."""
    from compress.runtime import SamplingParams
    with pytest.raises(RuntimeError, match="LLM.generate: this LLM's engine is run by the thread 'compress-engine'"):
        embedded_llm.generate("Return the", SamplingParams(max_tokens=4, temperature=0))
    with pytest.raises(RuntimeError, match="LLM.stream: .*use a second LLM for direct calls"):
        next(embedded_llm.stream("Return the", SamplingParams(max_tokens=4, temperature=0)))
    with pytest.raises(RuntimeError, match="LLM.loglikelihood: this LLM's engine is run by the thread"):
        embedded_llm.loglikelihood([("Return the", " value")])
    with pytest.raises(RuntimeError, match="LLM.logits: "):
        embedded_llm.logits([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="LLM.token_logprobs: "):
        embedded_llm.token_logprobs([[1, 2, 3]])
    assert not embedded_llm.engine.has_unfinished()
    out = client(server).completions.create(model=MODEL_NAME, prompt="Return the", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4


def test_penalties_reach_the_runtime(server, direct_llm):
    """presence / frequency (OpenAI's) and repetition (vLLM's) penalties: the server's
    greedy text is the runtime's with the same penalties, and differs from plain greedy."""
    from compress.runtime import SamplingParams
    c = client(server)
    pen = dict(presence_penalty=0.5, frequency_penalty=1.0)
    out = c.completions.create(model=MODEL_NAME, prompt="Return the", max_tokens=24, temperature=0,
                               extra_body={"repetition_penalty": 1.3}, **pen)
    want = direct_llm.generate("Return the", SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3,
                                                              **pen))[0]
    plain = direct_llm.generate("Return the", SamplingParams(max_tokens=24, temperature=0))[0]
    assert out.choices[0].text == want.text and want.token_ids != plain.token_ids


def test_logit_bias_reaches_the_runtime(server, direct_llm):
    """OpenAI's logit_bias (token id strings): the server's greedy text is the runtime's
    with the same bias, and a banned token never appears."""
    from compress.runtime import SamplingParams
    plain = direct_llm.generate("Return the", SamplingParams(max_tokens=16, temperature=0))[0]
    banned = plain.token_ids[0]
    for call in ("completions", "chat"):
        c = client(server)
        kw = dict(model=MODEL_NAME, max_tokens=16, temperature=0, logit_bias={str(banned): -100, "42": 2.5})
        if call == "completions":
            text = c.completions.create(prompt="Return the", **kw).choices[0].text
            want = direct_llm.generate("Return the", SamplingParams(max_tokens=16, temperature=0,
                                                                      logit_bias={banned: -100, 42: 2.5}))[0]
            assert text == want.text and banned not in want.token_ids
        else:
            reply = c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)
            ids = server.state.encode(reply.choices[0].message.content, add_special_tokens=False)
            assert banned not in ids


def test_n_choices(server, direct_llm):
    """n choices a prompt (OpenAI's index order: prompt i's j-th is i * n + j): seeded, the
    j-th is the runtime's sample with seed + j, so the n differ; greedy, they are equal; the
    prompt's tokens count once in the usage; streamed chat gives the same n replies."""
    from compress.runtime import SamplingParams
    c = client(server)
    out = c.completions.create(model=MODEL_NAME, prompt=["Return the", "Hello"], n=3, max_tokens=8,
                               temperature=1.0, seed=11)
    texts = [ch.text for ch in sorted(out.choices, key=lambda ch: ch.index)]
    for i, prompt in enumerate(["Return the", "Hello"]):
        for j in range(3):
            want = direct_llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=11 + j))[0]
            assert texts[i * 3 + j] == want.text
    assert len(set(texts[:3])) > 1
    prompt_tokens = sum(len(server.state.encode(p, True)) for p in ["Return the", "Hello"])
    assert out.usage.prompt_tokens == prompt_tokens
    greedy = c.completions.create(model=MODEL_NAME, prompt="Return the", n=2, max_tokens=8, temperature=0)
    assert greedy.choices[0].text == greedy.choices[1].text
    echo = c.completions.create(model=MODEL_NAME, prompt="Return the", n=2, max_tokens=1, temperature=0, echo=True,
                                logprobs=1)    # the prompt scored once, its logprobs in both choices
    one = c.completions.create(model=MODEL_NAME, prompt="Return the", max_tokens=1, temperature=0, echo=True,
                               logprobs=1)
    assert [ch.logprobs.token_logprobs for ch in echo.choices] == [one.choices[0].logprobs.token_logprobs] * 2
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=8, temperature=1.0,
              seed=5)
    whole = c.chat.completions.create(**kw)
    assert [ch.index for ch in whole.choices] == [0, 1, 2] and len({ch.message.content for ch in whole.choices}) > 1
    streamed = [""] * 3
    for event in c.chat.completions.create(stream=True, **kw):
        for ch in event.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == [ch.message.content for ch in whole.choices]


def test_streamed_text_equals_the_whole_answer(server):
    c = client(server)
    whole = c.completions.create(model=MODEL_NAME, prompt="Return a list of", max_tokens=20, temperature=0)
    pieces, finish, usage = [], None, None
    for chunk in c.completions.create(model=MODEL_NAME, prompt="Return a list of", max_tokens=20, temperature=0,
                                      stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.text)
            finish = ch.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].text and len(pieces) > 2
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_cut_streamed_and_whole_text_alike(server):
    c = client(server)
    whole = c.completions.create(model=MODEL_NAME, prompt="Return the", max_tokens=30, temperature=0)
    text = whole.choices[0].text
    stop = text[8:11]
    assert stop.strip(), text
    cut = c.completions.create(model=MODEL_NAME, prompt="Return the", max_tokens=30, temperature=0, stop=[stop])
    streamed = "".join(ch.text for chunk in c.completions.create(
        model=MODEL_NAME, prompt="Return the", max_tokens=30, temperature=0, stop=[stop], stream=True)
        for ch in chunk.choices)
    assert cut.choices[0].text == text[:text.index(stop)] == streamed
    assert cut.choices[0].finish_reason == "stop"


def test_chat_and_streamed_chat(server):
    c = client(server)
    msgs = [{"role": "system", "content": "Answer in Python terms."}, {"role": "user", "content": "Sort a list"}]
    whole = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    deltas = list(c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16, temperature=0,
                                            stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == whole.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    # the prompt is the plain template of the messages (the embedded tokenizer has none)
    ids = requests.post(server.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    assert whole.usage.prompt_tokens == len(ids)
    assert server.state.decode(ids, skip_special_tokens=False).startswith("<s>system: Answer")


def test_a_conversation_goes_on_with_the_sdks_message_object_and_nulls(server):
    """Clients append the SDK's answer object to the history, and dict-built bodies send
    unset fields as null: both are accepted (null is the default)."""
    c = client(server)
    msgs = [{"role": "user", "content": "Sort a list"}]
    first = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=8, temperature=0)
    msgs += [first.choices[0].message, {"role": "user", "content": "Again"}]
    again = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=8, temperature=0)
    assert again.choices[0].message.role == "assistant" and again.usage.prompt_tokens > first.usage.prompt_tokens
    raw = requests.post(server.url + "/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": msgs[:1], "max_tokens": 8, "temperature": 0, "top_p": None,
        "stop": None, "stream": None, "n": None, "presence_penalty": None, "response_format": {"type": "text"},
        "tools": None, "tool_choice": None})
    assert raw.status_code == 200, raw.text
    assert raw.json()["choices"][0]["message"]["content"] == first.choices[0].message.content


def test_seeds_are_reproducible(server):
    c = client(server)

    def sample(seed):
        return c.completions.create(model=MODEL_NAME, prompt="Return the", max_tokens=24, temperature=1.0,
                                    top_p=0.95, seed=seed).choices[0].text

    a, b, other = sample(7), sample(7), sample(8)
    assert a == b and a != other
    streamed = "".join(ch.text for chunk in c.completions.create(
        model=MODEL_NAME, prompt="Return the", max_tokens=24, temperature=1.0, top_p=0.95, seed=7, stream=True)
        for ch in chunk.choices)
    assert streamed == a


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": "abc \ud83d"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "abc \ud83d"]}, "prompt.1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc \ud83d"}]}, "messages.0.content"),
    ("/tokenize", {"prompt": "\udc00"}, "prompt"),
])
def test_an_unpaired_surrogate_is_a_400_naming_the_field(server, route, body, param):
    raw = json.dumps(body).encode()     # ensure_ascii: "\\ud83d", the JSON escape of half a surrogate pair
    assert b"\\ud" in raw
    r = requests.post(server.url + route, data=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"]


def test_generation_config_defaults_fill_what_a_request_leaves_out(server, references):
    """--generation-config auto: the model's sampling fields for those a request does not
    name (here temperature 0: greedy); a request's own temperature wins."""
    server.state.config.sampling_defaults = {"temperature": 0.0}
    body = {"prompt": references["prompts"][0], "max_tokens": 12}
    got = requests.post(server.url + "/v1/completions", json=body).json()["choices"][0]["text"]
    assert got == references["texts"][0]
    sampled = {requests.post(server.url + "/v1/completions", json={**body, "temperature": 1.5, "seed": s}).json()
               ["choices"][0]["text"] for s in range(3)}
    assert sampled != {references["texts"][0]}


def test_a_negative_seed_is_a_seed(server):
    c = client(server)
    outs = [c.completions.create(model=MODEL_NAME, prompt="Return the", max_tokens=8, temperature=1.0,
                                 seed=-1).choices[0].text for _ in range(2)]
    assert outs[0] == outs[1]


# ---------------------------------------------------------------- tokenizer routes
def test_tokenizer_routes_as_lm_eval_reads_them(server):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    assert check_remote_tokenizer_support(server.url + "/v1/completions")
    tok = RemoteTokenizer(server.url + "/v1/completions")
    ids = tok.encode("Return the number of items")
    assert ids == server.state.encode("Return the number of items", add_special_tokens=False)
    assert tok.decode(ids) == "Return the number of items"
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "user: x\nassistant:"
    info = requests.get(server.url + "/tokenizer_info").json()
    assert info["model_max_length"] == 1024 and info["eos_token"] == "</s>"
    models = requests.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]


def test_health_and_metrics(server):
    assert requests.get(server.url + "/health").json() == {"status": "ok"}
    requests.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    text = requests.get(server.url + "/metrics").text
    for name in ("compress_requests_total", "compress_requests_running", "compress_requests_waiting",
                 "compress_queue_length", "compress_kv_blocks_used", "compress_kv_blocks_total",
                 "compress_kv_slots_reserved_unused",
                 "compress_generation_tokens_per_second", "compress_generated_tokens_total"):
        assert f"\n{name}" in text or text.startswith(f"# HELP {name}"), name
    assert 'compress_requests_total{route="/v1/completions",status="200"}' in text


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_k": -5}, "top_k"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "logprobs": 99}, "logprobs"),
    ({"prompt": "a", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "a", "frobnicate": True}, "frobnicate"),
    ({"prompt": "a", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [5, 999999]}, "prompt"),
    ({"prompt": [1] * 1024}, "prompt"),
    ({"prompt": "a", "max_tokens": 5000}, "max_tokens"),
    ({"prompt": ["a", [1] * 1100]}, "prompt.1"),
    ({"prompt": "a", "model": "gpt-4"}, "model"),
])
def test_completion_errors_name_the_field(server, body, param):
    r = requests.post(server.url + "/v1/completions", json=body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"]


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 2000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 2000}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "word " * 1100}]}, "messages"),
    ({"messages": [{"role": "user"}], "temperature": 9}, "temperature"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": ["enable_thinking"]},
     "chat_template_kwargs"),
])
def test_chat_errors_name_the_field(server, body, param):
    r = requests.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_malformed_json_and_unknown_routes(server):
    r = requests.post(server.url + "/v1/completions", data=b'{"prompt": "a",', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = requests.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = requests.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_api_key(server):
    server.state.config.api_key = "sekrit"
    r = requests.get(server.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert requests.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert requests.post(server.url + "/tokenize", json={"prompt": "a"}).status_code == 401
    assert requests.get(server.url + "/metrics").status_code == 401
    assert requests.get(server.url + "/health").status_code == 200          # open for probes
    assert client(server, api_key="sekrit").models.list().data[0].id == MODEL_NAME
    out = client(server, api_key="sekrit").completions.create(model=MODEL_NAME, prompt="a", max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop")
    import openai
    with pytest.raises(openai.AuthenticationError):
        client(server, api_key="nope").completions.create(model=MODEL_NAME, prompt="a", max_tokens=2)


# ---------------------------------------------------------------- limits, disconnects
@pytest.fixture
def slow_engine(server, monkeypatch):
    """Engine steps of at least 20 ms, so long requests stay in flight while a test looks."""
    engine = server.state.engine_loop.engine
    step = engine.step

    def slow_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


def _open_stream(server, max_tokens=900):
    """A long greedy stream, after its first event. The line iterator is kept with the
    response: dropping it would close the connection (urllib3 releases it)."""
    r = requests.post(server.url + "/v1/completions", json={
        "prompt": "Return the", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True},
        stream=True, timeout=30)
    assert r.status_code == 200, r.text
    r.lines = r.iter_lines()
    while not next(r.lines):
        pass
    return r


def test_queue_full_is_503_with_retry_after(server, slow_engine):
    server.state.config.max_num_seqs = 1
    server.state.config.max_queue = 1
    first, second = _open_stream(server), None
    try:
        second = requests.post(server.url + "/v1/completions", json={
            "prompt": "a", "max_tokens": 900, "ignore_eos": True, "stream": True}, stream=True, timeout=30)
        assert second.status_code == 200
        third = requests.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert third.status_code == 503, third.text
        assert third.headers["Retry-After"] == "1" and third.json()["error"]["code"] == "queue_full"
    finally:
        first.close()
        if second is not None:
            second.close()
    stats = wait_idle(server)
    assert stats["kv_blocks_used"] == 0
    assert requests.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


def test_client_killed_mid_stream_frees_its_request(server, slow_engine):
    before = server.state.disconnected
    responses = [_open_stream(server) for _ in range(3)]
    assert server.state.engine_loop.stats["kv_blocks_used"] > 0
    for r in responses:
        # a reset, as a killed process leaves it
        sock = socket.fromfd(r.raw._fp.fp.raw.fileno(), socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()
        r.close()
    stats = wait_idle(server)
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0
    # a non-streaming request whose client goes away is aborted too
    s = socket.create_connection((server.host, server.port))
    body = json.dumps({"prompt": "Return the", "max_tokens": 900, "ignore_eos": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 5
    while server.state.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    s.close()
    stats = wait_idle(server)
    assert stats["kv_blocks_used"] == 0 and server.state.disconnected >= before + 1


def test_request_timeout(server):
    server.state.config.request_timeout = 0.05
    r = requests.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1000, "ignore_eos": True})
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    lines = [l for l in requests.post(server.url + "/v1/completions", json={
        "prompt": "a", "max_tokens": 1000, "ignore_eos": True, "stream": True}).iter_lines() if l]
    assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "request_timeout"
    assert lines[-1] == b"data: [DONE]"
    assert wait_idle(server)["kv_blocks_used"] == 0


def test_concurrent_requests_are_batched(server):
    c = client(server)
    results = {}

    def run(i):
        results[i] = c.completions.create(model=MODEL_NAME, prompt="Return the", max_tokens=12,
                                          temperature=0).choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(set(results.values())) == 1 and len(results) == 6
    assert wait_idle(server)["kv_blocks_used"] == 0



def test_a_failing_engine_step_is_a_500_and_the_server_goes_on(server, monkeypatch):
    engine = server.state.engine_loop.engine
    step = engine.step

    def failing_step():
        monkeypatch.setattr(engine, "step", step)        # fail once
        raise RuntimeError("kernel exploded " + "x" * 5000)

    monkeypatch.setattr(engine, "step", failing_step)
    r = requests.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 4})
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "kernel exploded" in message and len(message) < 400
    assert wait_idle(server)["kv_blocks_used"] == 0
    assert requests.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 4}).status_code == 200
