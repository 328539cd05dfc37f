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
from service.tools.answer import AnswerEvent, AnswerParser, AnswerPlan, ReasoningEvent, answer_finish_reason
from service.tools.parser import ArgumentsEvent, CallStartEvent, TextEvent
from service.tools.reasoning import count_reasoning_tokens


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


# One encoder for every chunk: json.dumps(..., ensure_ascii=False) would build one per call.
_encode = json.JSONEncoder(ensure_ascii=False).encode


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event line."""
    return f"data: {_encode(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"

_CHUNK_KEYS = ("id", "object", "created", "model", "choices")


class ChunkLines:
    """The SSE lines of one stream's chunks, the fields every chunk repeats (id, object, created,
    model) encoded once: `line(chunk)` is `sse(chunk)`, with less work per token."""

    def __init__(self, request_id: str, object_: str, created: int, model: str) -> None:
        self._fields = (request_id, object_, created, model)
        head = json.dumps(dict(zip(_CHUNK_KEYS, (*self._fields, []))), ensure_ascii=False)
        self._head = "data: " + head[:-2]  # up to and with '"choices": ['

    def line(self, chunk: dict[str, Any]) -> str:
        if tuple(chunk) == _CHUNK_KEYS and chunk["choices"] and \
                (chunk["id"], chunk["object"], chunk["created"], chunk["model"]) == self._fields:
            return self._head + ", ".join(_encode(c) for c in chunk["choices"]) + "]}\n\n"
        return sse(chunk)


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
        self.lines = ChunkLines(request_id, "text_completion", created, model)

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

    def chunks(self, index: int, text: str, lps: list[TokenLogprob], finish_reason: str | None,
               offset: int = 0) -> list[dict[str, Any]]:
        return [self.chunk(index, text, lps, finish_reason, offset)]

    def add_usage_details(self, usage_: dict[str, Any], choices: list[ChoiceState]) -> dict[str, Any]:
        return usage_

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


class ChatFormat:
    """Bodies of `/v1/chat/completions`. Each choice's text goes through its answer's parser
    (service/tools/answer.py): reasoning comes back as `reasoning_content` (and `reasoning`),
    calls as `tool_calls`, streamed as OpenAI streams them (a call's first delta carries its
    index, id, type and name; the next ones pieces of its JSON arguments)."""

    def __init__(self, request_id: str, model: str, created: int, tokenizer: Any, logprobs: int | None,
                 plan: AnswerPlan | None = None) -> None:
        self.request_id, self.model, self.created = request_id, model, created
        self.lines = ChunkLines(request_id, "chat.completion.chunk", created, model)
        self._tokens = _TokenText(tokenizer)
        self._tokenizer = tokenizer
        self._want_logprobs = logprobs is not None
        self._plan = plan or AnswerPlan(None, None, None)
        self._parsers: dict[int, AnswerParser] = {}
        self._call_ids: dict[int, list[str]] = {}

    @property
    def thinks(self) -> bool:
        """The served model thinks: answers carry reasoning fields (null when it did not)."""
        return self._plan.reasoning is not None

    def _parser(self, index: int) -> AnswerParser:
        if index not in self._parsers:
            self._parsers[index] = self._plan.parser()
            self._call_ids[index] = []
        return self._parsers[index]

    def _call_id(self, index: int, call: int) -> str:
        ids = self._call_ids[index]
        while len(ids) <= call:
            ids.append(self._plan.tool_format.call_id() if self._plan.tool_format else f"call_{uuid.uuid4().hex[:24]}")
        return ids[call]

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

    def _delta(self, index: int, event: AnswerEvent) -> dict[str, Any]:
        if isinstance(event, ReasoningEvent):
            return {"reasoning_content": event.text, "reasoning": event.text}
        if isinstance(event, TextEvent):
            return {"content": event.text}
        if isinstance(event, CallStartEvent):
            return {"tool_calls": [{"index": event.index, "id": self._call_id(index, event.index), "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}

    def _finish_reason(self, index: int, finish_reason: str | None) -> str | None:
        return answer_finish_reason(finish_reason, self._parser(index).calls)

    def chunks(self, index: int, text: str, lps: list[TokenLogprob], finish_reason: str | None,
               offset: int = 0) -> list[dict[str, Any]]:
        """The chunks of one delta of choice `index`: one per kind of output it holds (the
        logprobs with the first, the finish reason with the last)."""
        events = self._parser(index).feed(text, final=finish_reason is not None)
        deltas = [self._delta(index, e) for e in events] or [{} if finish_reason is not None else {"content": ""}]
        out = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            out.append(self._chunk([{"index": index, "delta": delta,
                                     "logprobs": self._logprobs(lps) if k == 0 else None,
                                     "finish_reason": self._finish_reason(index, finish_reason) if last else None}]))
        return out

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        return self._chunk([]) | {"usage": usage_}

    def add_usage_details(self, usage_: dict[str, Any], choices: list[ChoiceState]) -> dict[str, Any]:
        """`completion_tokens_details.reasoning_tokens` for a model that thinks (every choice's
        text must have gone through its parser)."""
        if self.thinks:
            reasoning = sum(count_reasoning_tokens(c.token_ids, self._parser(c.index).reasoning_chars,
                                                   self._tokenizer) for c in choices)
            usage_["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage_

    def message(self, choice: ChoiceState) -> tuple[dict[str, Any], str | None]:
        """The whole assistant message of a finished choice and its finish reason."""
        events = self._parser(choice.index).feed(choice.text, final=True)
        text = "".join(e.text for e in events if isinstance(e, TextEvent))
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningEvent))
        calls = [(e.index, e.name) for e in events if isinstance(e, CallStartEvent)]
        args: dict[int, str] = {}
        for e in events:
            if isinstance(e, ArgumentsEvent):
                args[e.index] = args.get(e.index, "") + e.text
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if self.thinks:
            message["reasoning_content"] = message["reasoning"] = reasoning or None
        if calls:
            message["tool_calls"] = [{"id": self._call_id(choice.index, i), "type": "function",
                                      "function": {"name": name, "arguments": args.get(i, "")}} for i, name in calls]
        return message, self._finish_reason(choice.index, choice.finish_reason)

    def response(self, choices: list[ChoiceState], prefixes: list[str], usage_: dict[str, Any]) -> dict[str, Any]:
        body = []
        for c in choices:
            message, reason = self.message(c)
            body.append({"index": c.index, "message": message, "logprobs": self._logprobs(c.logprobs),
                         "finish_reason": reason})
        return {"id": self.request_id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": body, "usage": self.add_usage_details(usage_, choices)}
