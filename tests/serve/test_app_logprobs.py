"""Logprobs over HTTP: OpenAI's legacy completions layout (the chosen token among the
alternatives, text_offset into the returned text, whole or streamed), echo scoring as
lm-eval reads it, and the chat layout."""
from __future__ import annotations

import json

import pytest
import requests

from conftest import MODEL_NAME, client


def test_echo_logprobs_score_the_prompt(server, references):
    ids = references["score_ids"]
    r = requests.post(server.url + "/v1/completions", json={
        "model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(references["score_logprobs"], abs=1e-4)
    for token, chosen, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert len(top) in (1, 2) and max(top.values()) >= chosen and top[token] == chosen
    # max_tokens=0: the prompt only
    r = requests.post(server.url + "/v1/completions", json={
        "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2})
    choice = r.json()["choices"][0]
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids) and choice["finish_reason"] == "length"
    assert all(len(t) in (2, 3) for t in choice["logprobs"]["top_logprobs"][1:])
    assert choice["text"] == server.state.decode(ids)


def test_generated_logprobs(server):
    c = client(server)
    out = c.completions.create(model=MODEL_NAME, prompt="Return the", max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and chosen == pytest.approx(max(top.values()))     # greedy: the top one
    chat = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                     temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 3
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)


def test_the_chosen_token_is_among_the_alternatives(server):
    """OpenAI's legacy layout: up to logprobs + 1 alternatives, the chosen token always among
    them (lm-eval's greedy check takes the max of them); logprobs=0 gives the chosen one."""
    for logprobs in (0, 1):
        r = requests.post(server.url + "/v1/completions", json={
            "prompt": "Return the number of", "max_tokens": 8, "temperature": 1.5, "seed": 3, "logprobs": logprobs})
        lp = r.json()["choices"][0]["logprobs"]
        for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert top[token] == chosen and len(top) <= logprobs + 1
        if logprobs == 1:   # at temperature 1.5 some token is not the top one
            assert any(len(top) == 2 for top in lp["top_logprobs"])


def test_echoed_text_offsets_point_into_the_returned_text(server):
    """OpenAI's legacy contract: text[text_offset[i]:] starts with token i. The BOS the
    tokenizer adds takes no room in the echoed prompt (offset 0, as does the first word)."""
    r = requests.post(server.url + "/v1/completions", json={
        "prompt": "Return the number of items", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1})
    choice = r.json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert lp["tokens"][0] == "<s>" and lp["text_offset"][:2] == [0, 0]
    for token, offset in list(zip(lp["tokens"], lp["text_offset"]))[1:]:
        assert text[offset:].startswith(token), (token, offset, text)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] < len(text)


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_text_offsets_go_on_as_the_whole_answers_do(server, echo):
    body = {"prompt": "Return the number of", "max_tokens": 10, "temperature": 0, "logprobs": 1, "echo": echo}
    whole = requests.post(server.url + "/v1/completions", json=body).json()["choices"][0]["logprobs"]
    offsets, tokens = [], []
    with requests.post(server.url + "/v1/completions", json={**body, "stream": True}, stream=True) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                if lp:
                    offsets += lp["text_offset"]
                    tokens += lp["tokens"]
    assert tokens == whole["tokens"] and offsets == whole["text_offset"]
    assert offsets == sorted(offsets) and len(set(offsets)) > 5
