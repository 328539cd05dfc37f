"""Chat messages through the checkpoint's Jinja2 template, or the documented ChatML default."""

from __future__ import annotations

import pytest

from service.errors import APIError
from service.openai.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from service.openai.protocol import ChatMessage

# The shape of many HF templates: a bos token, a check that raises, roles in brackets.
HF_STYLE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def _msgs(*pairs: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in pairs]


def test_default_template_is_chatml() -> None:
    template = ChatTemplate(None)
    assert template.is_default and template.source == DEFAULT_CHAT_TEMPLATE
    text = template.render(_msgs(("system", "Be terse."), ("user", "Hi")))
    assert text == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not template.render(_msgs(("user", "Hi")), add_generation_prompt=False).endswith("assistant\n")


def test_checkpoint_template_with_special_tokens() -> None:
    template = ChatTemplate(HF_STYLE, bos_token="<s>", eos_token="</s>")
    text = template.render(_msgs(("user", "Hi"), ("assistant", "Hello"), ("user", "Bye")))
    assert text == "<s>[user] Hi</s>\n[assistant] Hello</s>\n[user] Bye</s>\n[assistant] "


def test_text_parts_are_joined() -> None:
    message = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]})
    assert ChatTemplate(HF_STYLE).render([message]) == "[user] ab\n[assistant] "


def test_a_template_that_refuses_is_a_400_on_messages() -> None:
    with pytest.raises(APIError) as err:
        ChatTemplate(HF_STYLE).render(_msgs(("assistant", "x")))
    assert err.value.status == 400 and err.value.param == "messages"
    assert "roles must alternate" in err.value.message


def test_a_template_cannot_reach_python_internals() -> None:
    sneaky = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(APIError):
        ChatTemplate(sneaky).render(_msgs(("user", "x")))


def test_a_broken_template_falls_back_to_the_default() -> None:
    template = ChatTemplate("{% for m in messages %}")
    assert template.is_default
    assert template.render(_msgs(("user", "Hi"))).startswith("<|im_start|>user\nHi")
