"""Request validation: every bad body is an APIError (400) naming its field."""
import pytest

from compress.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, TokenizeRequest,
                                     parse_json_body, validate)


def error_of(model, data) -> APIError:
    with pytest.raises(APIError) as info:
        validate(model, data)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("max_tokens", -1), ("logprobs", 21), ("logprobs", -1), ("n", 0), ("n", 129), ("seed", -2**63 - 1), ("seed", 2**63),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("temperature", "0.5"), ("max_tokens", 1.5), ("stream", "yes"),
    ("best_of", 3), ("stop", 5),
])
def test_bad_completion_values_name_their_field(field, value):
    err = error_of(CompletionRequest, {"prompt": "x", field: value})
    assert err.param == field and err.message.startswith(f"{field}:"), err.message
    assert err.body()["error"]["param"] == field


def test_unknown_field_is_named():
    err = error_of(CompletionRequest, {"prompt": "x", "temprature": 0.5})
    assert err.param == "temprature" and "unknown field" in err.message


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], 3, None, [1.5], [True, 2]])
def test_bad_prompts(prompt):
    assert error_of(CompletionRequest, {"prompt": prompt}).param == "prompt"


def test_missing_prompt():
    assert error_of(CompletionRequest, {"max_tokens": 3}).param == "prompt"


def test_prompt_forms_are_normalized():
    assert validate(CompletionRequest, {"prompt": "a"}).prompt == ["a"]
    assert validate(CompletionRequest, {"prompt": [1, 2]}).prompt == [[1, 2]]
    assert validate(CompletionRequest, {"prompt": ["a", [3]]}).prompt == ["a", [3]]


def test_max_tokens_zero_needs_echo():
    assert error_of(CompletionRequest, {"prompt": "a", "max_tokens": 0}).param == "max_tokens"
    assert validate(CompletionRequest, {"prompt": "a", "max_tokens": 0, "echo": True}).max_tokens == 0


def test_stream_options_need_stream():
    err = error_of(CompletionRequest, {"prompt": "a", "stream_options": {"include_usage": True}})
    assert err.param == "stream_options"


def test_chat_messages_nested_errors_name_the_path():
    err = error_of(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"},
                                                        {"role": "robot", "content": "x"}]})
    assert err.param.startswith("messages.1"), err.param
    err = error_of(ChatCompletionRequest, {"messages": []})
    assert err.param == "messages"
    err = error_of(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert err.param.startswith("messages.0.content"), err.param


def test_chat_max_tokens_conflicts_and_logprob_flags():
    msgs = [{"role": "user", "content": "hi"}]
    assert error_of(ChatCompletionRequest, {"messages": msgs, "max_tokens": 2,
                                            "max_completion_tokens": 3}).param == "max_completion_tokens"
    assert error_of(ChatCompletionRequest, {"messages": msgs, "top_logprobs": 2}).param == "top_logprobs"
    body = validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_completion_tokens": 4})
    assert body.requested_max_tokens() == 4 and body.plain_messages()[0]["content"] == "a\nb"


def test_tokenize_needs_one_input():
    assert error_of(TokenizeRequest, {}).param == "prompt"
    assert error_of(TokenizeRequest, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}).param == "prompt"


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b'{"a": NaN}', b"\xff\xfe", b""])
def test_malformed_json(raw):
    with pytest.raises(APIError) as info:
        parse_json_body(raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"


def test_null_means_the_default_for_optional_fields():
    body = validate(CompletionRequest, {"prompt": "x", "temperature": None, "top_p": None, "n": None,
                                        "stream": None, "presence_penalty": None, "stop": None, "seed": None})
    assert (body.temperature, body.top_p, body.n, body.stream, body.stop_list()) == (1.0, 1.0, 1, False, [])
    chat = validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi", "name": None}],
                                            "logprobs": None, "max_tokens": None, "frequency_penalty": None})
    assert chat.logprobs is False and chat.requested_max_tokens() is None
    assert error_of(ChatCompletionRequest, {"messages": None}).param == "messages"


@pytest.mark.parametrize("field,neutral,unsupported", [
    ("response_format", {"type": "text"}, {"type": "json_object"}),
    ("tools", [], [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "none", "required"),
    ("store", False, True),
    ("service_tier", "auto", "flex"),
])
def test_openai_fields_are_accepted_at_their_neutral_value_only(field, neutral, unsupported):
    msgs = [{"role": "user", "content": "hi"}]
    assert getattr(validate(ChatCompletionRequest, {"messages": msgs, field: neutral}), field) == neutral
    err = error_of(ChatCompletionRequest, {"messages": msgs, field: unsupported})
    assert err.param == field and "unknown field" not in err.message, err.message


def test_an_assistant_message_sent_back_as_the_sdk_dumps_it_is_accepted():
    back = {"role": "assistant", "content": "hello", "refusal": None, "annotations": [], "tool_calls": None,
            "name": None}
    body = validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}, back,
                                                         {"role": "user", "content": "again"}]})
    assert [m["content"] for m in body.plain_messages()] == ["hi", "hello", "again"]
    err = error_of(ChatCompletionRequest, {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]})
    assert err.param == "messages.0.tool_calls", err.param
