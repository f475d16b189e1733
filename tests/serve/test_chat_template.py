"""The plain chat template of tokenizers without one."""
from types import SimpleNamespace

import pytest

from compress.serve.chat_template import PLAIN_TEMPLATE_STOPS, default_stops, render_chat


def test_plain_template():
    tok = SimpleNamespace(chat_template=None, bos_token="<s>")
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert render_chat(tok, msgs) == "<s>system: Be terse.\nuser: Hi\nassistant:"
    assert render_chat(tok, msgs, add_generation_prompt=False) == "<s>system: Be terse.\nuser: Hi\n"
    assert default_stops(tok) == PLAIN_TEMPLATE_STOPS


def test_own_template_is_used():
    calls = []

    class Tok:
        chat_template = "{{ x }}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            calls.append((messages, tokenize, add_generation_prompt))
            return "rendered"

    assert render_chat(Tok(), [{"role": "user", "content": "a"}]) == "rendered"
    assert calls == [([{"role": "user", "content": "a"}], False, True)] and default_stops(Tok()) == []


THINKING_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>{% endif %}"
                     "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
                     "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('a user goes first') }}{% endif %}")


def thinking_tokenizer():
    from tiny_models import make_tokenizer

    tok = make_tokenizer()
    tok.chat_template = THINKING_TEMPLATE
    return tok


def test_template_variables_reach_the_tokenizers_template():
    """chat_template_kwargs (vLLM's; Qwen3's enable_thinking) become template variables."""
    tok, msgs = thinking_tokenizer(), [{"role": "user", "content": "hi"}]
    assert render_chat(tok, msgs) == "<user>hi<assistant>"
    assert render_chat(tok, msgs, template_kwargs={"enable_thinking": False}) == "<user>hi<assistant><no-think>"
    assert render_chat(tok, msgs, template_kwargs={"enable_thinking": True}) == "<user>hi<assistant>"


def test_a_template_that_raises_is_a_400_naming_the_field():
    from compress.serve.chat import chat_prompt_ids
    from compress.serve.protocol import APIError

    state = SimpleNamespace(tokenizer=thinking_tokenizer())
    for kwargs, param in ((None, "messages"), ({"enable_thinking": False}, "chat_template_kwargs")):
        with pytest.raises(APIError) as err:
            chat_prompt_ids(state, [{"role": "assistant", "content": "x"}], template_kwargs=kwargs)
        assert err.value.status == 400 and err.value.param == param and "a user goes first" in err.value.message
