"""Chat messages -> one prompt string, through a Jinja2 chat template.

The template is the checkpoint tokenizer's `chat_template` (from `tokenizer_config.json` or
`chat_template.jinja`) when it has one. Otherwise `DEFAULT_CHAT_TEMPLATE` is used: ChatML,

    <|im_start|>system
    You are terse.<|im_end|>
    <|im_start|>user
    Hello<|im_end|>
    <|im_start|>assistant

chosen because it is widely known and marks roles unambiguously; the byte-level presets see
it as plain text. With tools it writes them, and earlier calls and their results, as Qwen2.5's
template does (Hermes format: `<tool_call>` blocks, `<tool_response>` turns), so a model without a
template of its own answers `tool_choice: auto` in that format.

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
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '<tools>' }}{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools><|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + (message['content'] or '') + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '\n<tool_call>\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endif %}{% endif %}"
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
        self._knows_developer = "developer" in self.source

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for `messages`; a template that refuses them is a 400 on `messages`.
        Messages (their tool calls and tool results too), `tools` (OpenAI tool definitions) and
        `template_kwargs` (a request's `chat_template_kwargs`, e.g. enable_thinking) reach the
        template as transformers' `apply_chat_template` passes them."""
        plain = [m.template_dict() for m in messages]
        if not self._knows_developer:  # OpenAI's newer name for the system role
            plain = [m | {"role": "system"} if m["role"] == "developer" else m for m in plain]
        try:
            return self._template.render(
                **(template_kwargs or {}),
                messages=plain,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
                tools=tools,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise APIError(f"The chat template refused these messages: {exc}", param="messages") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, RecursionError) as exc:
            # A template that fails on a shape it did not expect (e.g. content null where it
            # concatenates strings) is the request's problem, not the server's.
            raise APIError(f"The chat template cannot render these messages: {type(exc).__name__}: {exc}",
                           param="messages") from None
