"""How one chat answer is constrained and read back: the plan from the request's tools and
`tool_choice`, the served model's tool-call format and whether the prompt leaves it thinking,
and the parser that turns its text into reasoning, content and calls.

Shared by the API families that call tools (chat completions; the Responses and Messages APIs
map their own tool choices onto the same four: auto, required, a named function, none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.tools.formats import NO_PARAMETERS, JsonCallFormat, Tool, ToolFormat, json_grammar
from service.tools.parser import Event, TextEvent, ToolCallParser
from service.tools.reasoning import ReasoningMode, ReasoningSplitter


@dataclass
class ReasoningEvent:
    text: str


AnswerEvent = Event | ReasoningEvent


def forced_call_schema(tools: list[Tool]) -> dict[str, Any]:
    """What a forced call must be when the model has no format of its own:
    {"name": ..., "arguments": {...}} for one of `tools`."""
    return {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": t["name"]}, "arguments": t.get("parameters") or NO_PARAMETERS},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}


@dataclass(frozen=True)
class AnswerPlan:
    """`constraint`: SamplingParams keyword arguments (or None); `tool_format`: how calls are
    read back (None: the answer is text); `reasoning`: the thinking the answer may start with;
    `absorbs_response_format`: the constraint already holds the request's JSON schema."""

    constraint: dict[str, Any] | None
    tool_format: ToolFormat | None
    reasoning: ReasoningMode | None
    absorbs_response_format: bool = False

    def parser(self) -> "AnswerParser":
        return AnswerParser(self.reasoning, self.tool_format.parser() if self.tool_format else None)


def plan_answer(tools: list[Tool], choice: str, parallel: bool, fmt: ToolFormat | None,
                reasoning: ReasoningMode | None, response_schema: dict[str, Any] | None = None) -> AnswerPlan:
    """`choice`: "auto", "required", "none" or the name of the function to call. Raises
    ValueError when a tool cannot be written in the model's format."""
    prefix = reasoning.grammar_prefix() if reasoning else None
    if not tools or choice == "none":
        return AnswerPlan(None, None, reasoning)
    named = choice not in ("auto", "required")
    chosen = [t for t in tools if t["name"] == choice] if named else tools
    if fmt is None:
        if choice == "auto":
            return AnswerPlan(None, None, reasoning)  # no format to read calls in: a text answer
        schema = (chosen[0].get("parameters") or NO_PARAMETERS) if named else forced_call_schema(tools)
        core = json_grammar(schema)
        parse = JsonCallFormat(choice if named else None)
        if prefix is None:
            return AnswerPlan({"json_schema": schema}, parse, reasoning)
        return AnswerPlan(_tag(prefix, core), parse, reasoning)
    fmt.check_tools(chosen)
    absorbs = False
    if choice == "auto":
        core = fmt.structural_tag(chosen, required=False, parallel=parallel)
        if response_schema is not None:  # the answer is the JSON, or calls
            core = {"type": "or", "elements": [json_grammar(response_schema),
                                               fmt.calls_only(chosen, parallel)]}
            absorbs = True
    else:
        core = fmt.calls_only(chosen, parallel and not named)
    return AnswerPlan(_tag(prefix, core), fmt, reasoning, absorbs)


def _tag(prefix: dict[str, Any] | None, core: dict[str, Any]) -> dict[str, Any]:
    body = core if prefix is None else {"type": "sequence", "elements": [prefix, core]}
    return {"structural_tag": {"type": "structural_tag", "format": body}}


def answer_finish_reason(engine_reason: str | None, calls: list[Any]) -> str | None:
    """The finish reason an API reports: the engine's, "tool_calls" when a finished answer made
    complete calls (a call cut by max_tokens leaves "length")."""
    if engine_reason == "stop" and calls and all(c.complete for c in calls):
        return "tool_calls"
    return engine_reason


class AnswerParser:
    """One answer's text, chunk by chunk -> reasoning, content and call events."""

    def __init__(self, reasoning: ReasoningMode | None, tools: ToolCallParser | None) -> None:
        self._splitter = ReasoningSplitter(reasoning) if reasoning is not None and reasoning.thinks else None
        self._tools = tools

    @property
    def reasoning_chars(self) -> int:
        return self._splitter.reasoning_chars if self._splitter else 0

    @property
    def calls(self) -> list[Any]:
        return self._tools.calls if self._tools else []

    def feed(self, text: str, final: bool = False) -> list[AnswerEvent]:
        pieces = self._splitter.feed(text, final) if self._splitter else [("content", text)]
        events: list[AnswerEvent] = []
        flushed = False
        for k, (kind, piece) in enumerate(pieces):
            if kind == "reasoning":
                events.append(ReasoningEvent(piece))
            elif self._tools is not None:
                # The last piece of a finished answer is read as final, so that a call it leaves
                # incomplete is text, never a call (the whole answer at once must not differ
                # from its last chunk).
                flushed = final and k == len(pieces) - 1
                events.extend(self._tools.feed(piece, final=flushed))
            elif piece:
                events.append(TextEvent(piece))
        if final and self._tools is not None and not flushed:
            events.extend(self._tools.feed("", final=True))
        return _merged(events)


def _merged(events: list[AnswerEvent]) -> list[AnswerEvent]:
    """Neighbouring pieces of the same text (or the same call's arguments) as one."""
    out: list[AnswerEvent] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, (TextEvent, ReasoningEvent)) and type(last) is type(e):
            last.text += e.text  # type: ignore[union-attr]
        elif (last is not None and type(last) is type(e) and hasattr(e, "index") and hasattr(e, "text")
              and last.index == e.index):  # type: ignore[union-attr]
            last.text += e.text  # type: ignore[union-attr]
        else:
            out.append(e)
    return out
