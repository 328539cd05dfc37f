"""OpenAI response bodies and stream chunks, built from the engine's output deltas.

Plain dicts in the shapes of the OpenAI API (`text_completion`, `chat.completion`,
`chat.completion.chunk`); `json.dumps` of them is what leaves the server.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from model.engine.sequence import RequestOutput, TokenLogprob


@dataclass
class ChoiceState:
    """Everything generated so far for one choice."""

    index: int
    prompt_index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_chars: int = 0  # len(text), kept so streaming never re-joins the parts
    num_cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    prompt_logprobs: list[TokenLogprob] | None = None  # echo + logprobs: prompt tokens 1.. (engine order)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, out: RequestOutput) -> None:
        self.text_parts.append(out.new_text)
        self.num_chars += len(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs or [])
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def cached_tokens(choices: list[ChoiceState]) -> int:
    """Prompt tokens served from the prefix cache: per prompt, those cached before the request
    came (the fewest any of its choices found; later choices also reuse what the first computed)."""
    fewest: dict[int, int] = {}
    for c in choices:
        fewest[c.prompt_index] = min(fewest.get(c.prompt_index, c.num_cached_tokens), c.num_cached_tokens)
    return sum(fewest.values())


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event line."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class _TokenText:
    """Token id -> the text and bytes it stands for, as logprobs report them."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def bytes(self, token_id: int) -> bytes:
        try:
            return self._tokenizer.id_to_bytes(token_id)
        except (ValueError, IndexError):
            return b""

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


class CompletionFormat:
    """Bodies of `/v1/completions`."""

    def __init__(self, request_id: str, model: str, created: int, tokenizer: Any, logprobs: int | None,
                 echo_prompts: list[list[int]] | None = None) -> None:
        """`echo_prompts`: the token ids of each prompt when the request has echo + logprobs, so
        the echoed prompt carries logprobs too (the first token's are null, as in vLLM)."""
        self.request_id, self.model, self.created = request_id, model, created
        self._tokens = _TokenText(tokenizer)
        self._want_logprobs = logprobs is not None
        self.echo_prompts = echo_prompts

    def _logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if not self._want_logprobs:
            return None
        tokens = [self._tokens.text(lp.token_id) for lp in lps]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._tokens.text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def _echo_logprobs(self, prompt_ids: list[int], lps: list[TokenLogprob]) -> dict[str, Any]:
        tokens = [self._tokens.text(t) for t in prompt_ids]
        offsets, offset = [], 0
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [None] + [lp.logprob for lp in lps],
            "top_logprobs": [None] + [{self._tokens.text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def echo_chunk(self, index: int, prompt_index: int, prefix: str, lps: list[TokenLogprob]) -> dict[str, Any]:
        """The echoed prompt of choice `index` with its prompt logprobs (echo + logprobs)."""
        chunk = self.chunk(index, prefix, [], None)
        chunk["choices"][0]["logprobs"] = self._echo_logprobs(self.echo_prompts[prompt_index], lps)
        return chunk

    def chunk(self, index: int, text: str, lps: list[TokenLogprob], finish_reason: str | None,
              offset: int = 0) -> dict[str, Any]:
        """A stream chunk carrying `text` for choice `index`; `offset` is where it starts."""
        choice = {"index": index, "text": text, "logprobs": self._logprobs(lps, offset),
                  "finish_reason": finish_reason}
        return {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        return {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [], "usage": usage_}

    def response(self, choices: list[ChoiceState], prefixes: list[str], usage_: dict[str, int]) -> dict[str, Any]:
        """The whole (non-streamed) response; `prefixes[i]` is choice i's echoed prompt or ""."""
        body = []
        for c, prefix in zip(choices, prefixes):
            logprobs = self._logprobs(c.logprobs, len(prefix))
            if logprobs is not None and self.echo_prompts is not None and c.prompt_logprobs is not None:
                echoed = self._echo_logprobs(self.echo_prompts[c.prompt_index], c.prompt_logprobs)
                logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
            body.append({"index": c.index, "text": prefix + c.text, "logprobs": logprobs,
                         "finish_reason": c.finish_reason})
        return {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": body, "usage": usage_}


def tool_call_message(text: str, finish_reason: str | None, forced_tool: str) -> tuple[dict[str, Any], str | None]:
    """The assistant message and finish reason of a choice whose output was constrained to a
    tool call (`forced_tool`: "required", output {"name", "arguments"}, or the function's name,
    output its arguments). A call cut short (length, stop string) stays text."""
    try:
        value = json.loads(text) if finish_reason == "stop" else None
    except ValueError:
        value = None
    if value is None or (forced_tool == "required" and not isinstance(value, dict)):
        return {"role": "assistant", "content": text}, finish_reason
    if forced_tool == "required":
        name, arguments = value["name"], json.dumps(value["arguments"], ensure_ascii=False)
    else:
        name, arguments = forced_tool, text
    call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"


class ChatFormat:
    """Bodies of `/v1/chat/completions`. With `forced_tool` ("required" or a function name)
    each choice's text is a tool call: streamed chunks hold it back and the last one carries
    it whole as `delta.tool_calls`."""

    def __init__(self, request_id: str, model: str, created: int, tokenizer: Any, logprobs: int | None,
                 forced_tool: str | None = None) -> None:
        self.request_id, self.model, self.created = request_id, model, created
        self._tokens = _TokenText(tokenizer)
        self._want_logprobs = logprobs is not None
        self._forced_tool = forced_tool
        self._held: dict[int, str] = {}  # tool-call text streamed so far, by choice index

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self._tokens.bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def _logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self._want_logprobs:
            return None
        return {"content": [self._entry(lp.token_id, lp.logprob)
                            | {"top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in lps]}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices}

    def role_chunk(self, index: int) -> dict[str, Any]:
        """The first chunk of a choice: the assistant role, no text yet."""
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def chunk(self, index: int, text: str, lps: list[TokenLogprob], finish_reason: str | None,
              offset: int = 0) -> dict[str, Any]:
        if self._forced_tool is not None:
            return self._tool_chunk(index, text, lps, finish_reason)
        delta = {"content": text} if text or finish_reason is None else {}
        return self._chunk([{"index": index, "delta": delta, "logprobs": self._logprobs(lps),
                             "finish_reason": finish_reason}])

    def _tool_chunk(self, index: int, text: str, lps: list[TokenLogprob], finish_reason: str | None) -> dict[str, Any]:
        held = self._held.get(index, "") + text
        delta: dict[str, Any] = {}
        if finish_reason is None:
            self._held[index] = held
        else:
            self._held.pop(index, None)
            message, finish_reason = tool_call_message(held, finish_reason, self._forced_tool or "")
            if message.get("tool_calls"):
                delta = {"tool_calls": [{"index": 0} | call for call in message["tool_calls"]]}
            elif held:
                delta = {"content": held}
        return self._chunk([{"index": index, "delta": delta, "logprobs": self._logprobs(lps),
                             "finish_reason": finish_reason}])

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        return self._chunk([]) | {"usage": usage_}

    def response(self, choices: list[ChoiceState], prefixes: list[str], usage_: dict[str, int]) -> dict[str, Any]:
        body = []
        for c in choices:
            message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
            if self._forced_tool is not None:
                message, reason = tool_call_message(c.text, c.finish_reason, self._forced_tool)
            body.append({"index": c.index, "message": message, "logprobs": self._logprobs(c.logprobs),
                         "finish_reason": reason})
        return {"id": self.request_id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": body, "usage": usage_}
