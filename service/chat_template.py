"""Chat messages -> one prompt string, through a Jinja2 chat template.

The template is the checkpoint tokenizer's `chat_template` (from `tokenizer_config.json` or
`chat_template.jinja`) when it has one. Otherwise `DEFAULT_CHAT_TEMPLATE` is used: ChatML,

    <|im_start|>system
    You are terse.<|im_end|>
    <|im_start|>user
    Hello<|im_end|>
    <|im_start|>assistant

chosen because it is widely known and marks roles unambiguously; the byte-level presets see
it as plain text.

Templates render as `transformers`' `apply_chat_template` renders them (the same Jinja2
options, `loopcontrols`, `tojson`, `strftime_now`, `raise_exception`, the tokenizer's
`bos_token` / `eos_token` strings), and the text is then tokenized without the tokenizer's
post-processor (`add_special_tokens=False`), so a BOS the template writes is not added twice.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from service.errors import APIError
from service.openai.protocol import ChatMessage

logger = logging.getLogger(__name__)

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message: str) -> None:
    # Templates call raise_exception(...) to refuse a conversation (e.g. roles that do not alternate).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters, which changes the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)  # Llama 3.x templates write today's date into the system prompt


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # Sandboxed: a checkpoint's template is data from elsewhere and must not reach Python internals.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


class ChatTemplate:
    """Renders chat messages with one template (the tokenizer's, or the default)."""

    def __init__(self, template: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self.source = template or DEFAULT_CHAT_TEMPLATE
        self.is_default = template is None
        self._bos, self._eos = bos_token, eos_token
        try:
            self._template = _compile(self.source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            logger.warning("the tokenizer's chat template does not compile (%s); using the default", exc)
            self.source, self.is_default = DEFAULT_CHAT_TEMPLATE, True
            self._template = _compile(DEFAULT_CHAT_TEMPLATE)

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for `messages`; a template that refuses them is a 400 on `messages`.
        `tools` (OpenAI tool definitions) go to the template as HF templates expect them."""
        plain: list[dict[str, Any]] = [{"role": m.role, "content": m.text} | ({"name": m.name} if m.name else {})
                                       for m in messages]
        try:
            return self._template.render(
                messages=plain,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
                tools=tools,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise APIError(f"The chat template refused these messages: {exc}", param="messages") from None
