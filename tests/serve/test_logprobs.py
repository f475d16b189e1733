"""Prompt scoring and the two OpenAI logprob layouts."""
import torch

from compress.serve.logprobs import (TokenLogprob, chat_logprobs, completion_logprobs, from_engine,
                                     prompt_logprobs)
import compress.serve.logprobs as logprobs_module


def test_prompt_logprobs_match_log_softmax(monkeypatch):
    monkeypatch.setattr(logprobs_module, "ROWS_PER_CHUNK", 3)   # several chunks
    torch.manual_seed(0)
    logits = torch.randn(8, 11)
    ids = [4, 1, 7, 7, 0, 10, 3, 2]
    out = prompt_logprobs(logits, ids, top_k=2)
    lp = torch.log_softmax(logits, -1)
    assert out[0].logprob is None and out[0].token_id == 4
    for t in range(1, 8):
        assert out[t].token_id == ids[t]
        assert out[t].logprob == lp[t - 1, ids[t]].item()          # exactly: same op, same floats
        top = lp[t - 1].topk(2)
        assert [i for i, _ in out[t].top] == top.indices.tolist()
        assert out[t].top[0][1] == top.values[0].item()


def test_a_head_applied_per_chunk_scores_as_whole_logits_do(monkeypatch):
    """From hidden states with the head run a chunk at a time (no [T, V] tensor): the
    same entries as from the whole logits, each chunk's rows through the same head."""
    monkeypatch.setattr(logprobs_module, "ROWS_PER_CHUNK", 3)
    torch.manual_seed(1)
    hidden, head = torch.randn(8, 5), torch.randn(11, 5)
    calls = []

    def logits_of(h):
        calls.append(h.shape[0])
        return h @ head.t()

    ids = [4, 1, 7, 7, 0, 10, 3, 2]
    got = prompt_logprobs(hidden, ids, top_k=2, head=logits_of)
    # the first T - 1 positions are scored, in chunks [0, 3), [3, 6), [6, 7)
    want = prompt_logprobs(torch.cat([logits_of(hidden[i:min(i + 3, 7)]) for i in range(0, 7, 3)]
                                     + [logits_of(hidden[7:8])]), ids, top_k=2)
    assert calls[:3] == [3, 3, 1] and max(calls) <= 3
    assert [(e.token_id, e.logprob, e.top) for e in got] == [(e.token_id, e.logprob, e.top) for e in want]


def test_greedy_token_is_exactly_the_top_one():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = prompt_logprobs(logits, [0, 1, 2], top_k=1)
    assert out[1].logprob == out[1].top[0][1]        # token 1 is the argmax of row 0
    assert out[2].logprob < out[2].top[0][1]         # token 2 is not the argmax of row 1


def test_from_engine_shapes():
    assert from_engine(3, -0.5, 1).logprob == -0.5
    e = from_engine(3, (-0.5, {3: -0.5, 4: -1.0, 5: -0.1}), 2)
    assert e.logprob == -0.5 and e.top == [(5, -0.1), (3, -0.5)]
    assert from_engine(4, {3: -0.5, 4: -1.0}, 1).logprob == -1.0


def test_completion_and_chat_layouts():
    entries = [TokenLogprob(1, None), TokenLogprob(2, -0.3, [(2, -0.3), (3, -1.5)])]
    text = {1: "ab", 2: "c", 3: "d"}.__getitem__
    obj = completion_logprobs(entries, text)
    assert obj == {"tokens": ["ab", "c"], "token_logprobs": [None, -0.3],
                   "top_logprobs": [None, {"c": -0.3, "d": -1.5}], "text_offset": [0, 2]}
    chat = chat_logprobs(entries[1:], lambda t: text(t).encode())
    assert chat["content"][0]["token"] == "c" and chat["content"][0]["bytes"] == [99]
    assert [t["token"] for t in chat["content"][0]["top_logprobs"]] == ["c", "d"]


def test_the_chosen_token_joins_the_alternatives():
    """Not among the top k (or k = 0): still there, as OpenAI's legacy layout has it."""
    text = {1: "a", 2: "b", 3: "c"}.__getitem__
    obj = completion_logprobs([TokenLogprob(3, -2.0, [(1, -0.1)]), TokenLogprob(2, -0.5, [])], text, text_offset=4)
    assert obj["top_logprobs"] == [{"a": -0.1, "c": -2.0}, {"b": -0.5}]
    assert obj["text_offset"] == [4, 5]


def test_a_part_of_a_character_keeps_its_bytes_in_chat():
    raw = {5: b"\xc3", 6: b"\xa9"}.__getitem__
    chat = chat_logprobs([TokenLogprob(5, -0.1, [(5, -0.1)]), TokenLogprob(6, -0.2)], raw)
    assert [t["bytes"] for t in chat["content"]] == [[0xC3], [0xA9]]
    assert bytes(sum((t["bytes"] for t in chat["content"]), [])).decode() == "\u00e9"
    assert chat["content"][0]["token"] == "\ufffd"
