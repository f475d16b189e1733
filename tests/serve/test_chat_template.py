"""The plain chat template of tokenizers without one."""
from types import SimpleNamespace

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
