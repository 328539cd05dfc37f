"""One chat request running in the engine, as answer events: what every chat-like API builds on.

The Responses and Messages APIs turn their requests into the internal chat request (a
`ChatCompletionRequest`: messages with tool calls and results, tools, tool choice, sampling
fields) and start it with `OpenAIServing.start_chat`; a `ChatRun` then yields, per engine step,
each choice's answer events (reasoning, text, a call's start, pieces of its arguments), parsed by
the same `AnswerParser` as `/v1/chat/completions`, and at the end the usage and each choice's
finish. Each API only writes those events in its own shape.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from service.http.engine_call import EngineCall
from service.openai.formats import ChoiceState, cached_tokens
from service.tools.answer import AnswerEvent, AnswerPlan, answer_finish_reason
from service.tools.reasoning import count_reasoning_tokens


@dataclass
class AnswerDelta:
    """What one engine step added to one choice."""

    index: int
    events: list[AnswerEvent]
    finish_reason: str | None  # set on the choice's last delta: "stop", "length", "tool_calls", "abort"


@dataclass
class ChatUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int


class ChatRun:
    """A started chat request: `deltas()` once, then `usage()` and the per-choice results."""

    def __init__(self, request_id: str, run: EngineCall, plan: AnswerPlan, num_choices: int,
                 index_of: dict[str, int], num_prompt_tokens: int, tokenizer: Any) -> None:
        self.request_id = request_id
        self.plan = plan
        self.choices = [ChoiceState(k, 0) for k in range(num_choices)]
        self.parsers = [plan.parser() for _ in range(num_choices)]
        self.stop_reasons: list[str | int | None] = [None] * num_choices  # the stop string or id that matched
        self._run = run
        self._index_of = index_of
        self._num_prompt_tokens = num_prompt_tokens
        self._tokenizer = tokenizer

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens

    @property
    def thinks(self) -> bool:
        """The served model thinks (its answers carry reasoning, possibly empty)."""
        return self.plan.reasoning is not None

    def cancel(self) -> None:
        self._run.cancel()

    async def deltas(self) -> AsyncIterator[list[AnswerDelta]]:
        """Each engine step's deltas, one per choice that moved; the engine call is cancelled
        when the caller stops reading (a client that left)."""
        try:
            async for batch in self._run.batches():
                grouped: dict[int, list[Any]] = {}
                for out in batch:
                    grouped.setdefault(self._index_of[out.request_id], []).append(out)
                deltas = []
                for index, outs in grouped.items():
                    choice = self.choices[index]
                    for out in outs:
                        choice.add(out)
                        if out.finished:
                            self.stop_reasons[index] = out.stop_reason
                    text = "".join(out.new_text for out in outs)
                    finished = choice.finish_reason is not None
                    events = self.parsers[index].feed(text, final=finished)
                    deltas.append(AnswerDelta(index, events, self.finish_reason(index) if finished else None))
                yield deltas
        finally:
            self._run.cancel()

    async def collect(self) -> list[list[AnswerEvent]]:
        """Run to the end; each choice's events."""
        events: list[list[AnswerEvent]] = [[] for _ in self.choices]
        async for deltas in self.deltas():
            for d in deltas:
                events[d.index].extend(d.events)
        return events

    def finish_reason(self, index: int) -> str | None:
        """The engine's finish reason, "tool_calls" when a finished answer made complete calls."""
        return answer_finish_reason(self.choices[index].finish_reason, self.parsers[index].calls)

    def call_id(self) -> str:
        """A new id for a call, in the form the model's format wants (Mistral: 9 characters)."""
        fmt = self.plan.tool_format
        return fmt.call_id() if fmt is not None else f"call_{uuid.uuid4().hex[:24]}"

    def usage(self) -> ChatUsage:
        reasoning = sum(count_reasoning_tokens(c.token_ids, p.reasoning_chars, self._tokenizer)
                        for c, p in zip(self.choices, self.parsers)) if self.thinks else 0
        return ChatUsage(self._num_prompt_tokens, sum(c.num_output_tokens for c in self.choices),
                         cached_tokens(self.choices), reasoning)

