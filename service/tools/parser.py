"""Incremental tool-call parsing: a model's text, chunk by chunk, becomes content and calls.

A format (service/tools/formats.py) gives a trigger (the text that opens a call, such as
`<tool_call>`) and a region parser that reads the text from the trigger on. `ToolCallParser`
passes text through until a trigger, then re-reads the open region on every chunk, so its
result never depends on where the chunks were cut: a call's name goes out as soon as it is
known, its arguments as they are written (formats whose arguments are JSON text), and a region
that turns out not to be a call goes out as text. Under `tool_choice: auto` the output is
constrained to well-formed calls once the trigger is written (structural tags), so a region only
fails on free text (`tool_choice: none`, tests) or when generation is cut inside a call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TextEvent:
    text: str


@dataclass
class CallStartEvent:
    index: int  # of the call in this choice's answer
    name: str


@dataclass
class ArgumentsEvent:
    index: int
    text: str  # the next piece of the call's JSON arguments


Event = TextEvent | CallStartEvent | ArgumentsEvent


class NeedMore(Exception):
    """The text ends before the region can be decided."""


class NotACall(Exception):
    """The region's text cannot be a call in this format."""


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text so far (all of it once `complete`)
    complete: bool = False


@dataclass
class Region:
    """What a region parser found in the text from a trigger on."""

    calls: list[ParsedCall] = field(default_factory=list)
    end: int | None = None  # where the region ended (None: it goes on)
    failed: bool = False
    good_end: int = 0  # end of the last complete call: text after it is not a call when `failed`


class Scanner:
    """A cursor over a region's text. Each read raises `NeedMore` when the text ends before it
    is decided (unless `final`: the text is all there is) and `NotACall` when it cannot match."""

    def __init__(self, text: str, final: bool) -> None:
        self.text, self.pos, self.final = text, 0, final

    def more(self) -> None:
        raise NotACall() if self.final else NeedMore()

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n":
            self.pos += 1

    def literal(self, *options: str) -> str:
        """Consume one of `options`; the one consumed."""
        rest = self.text[self.pos:]
        for option in options:
            if rest.startswith(option):
                self.pos += len(option)
                return option
        if any(option.startswith(rest) for option in options):
            self.more()
        raise NotACall()

    def peek(self, option: str) -> bool:
        """Whether `option` comes next (consumed if it does)."""
        rest = self.text[self.pos:]
        if rest.startswith(option):
            self.pos += len(option)
            return True
        if option.startswith(rest) and not self.final:
            raise NeedMore()
        return False

    def string(self) -> str:
        """A JSON string."""
        self.literal('"')
        start = self.pos - 1
        i = self.pos
        while i < len(self.text):
            if self.text[i] == "\\":
                i += 2
                continue
            if self.text[i] == '"':
                self.pos = i + 1
                try:
                    return json.loads(self.text[start:self.pos])
                except ValueError:
                    raise NotACall() from None
            i += 1
        self.more()
        raise AssertionError  # unreachable: more() raises

    def json_object(self, on_partial: Callable[[str], None]) -> str:
        """A JSON object's text. While it is incomplete, `on_partial` gets what there is."""
        if self.at_end():
            self.more()
        if self.text[self.pos] != "{":
            raise NotACall()
        start, depth, i, in_string = self.pos, 0, self.pos, False
        while i < len(self.text):
            ch = self.text[i]
            if in_string:
                if ch == "\\":
                    i += 1
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    self.pos = i + 1
                    text = self.text[start:self.pos]
                    try:
                        if not isinstance(json.loads(text), dict):
                            raise NotACall()
                    except ValueError:
                        raise NotACall() from None
                    return text
            i += 1
        on_partial(self.text[start:])
        self.more()
        raise AssertionError

    def json_call(self, calls: list[ParsedCall], args_keys: tuple[str, ...]) -> None:
        """`{"name": NAME, "arguments": {...}}` (or another key of `args_keys`), appended to
        `calls` as soon as its arguments object opens."""
        self.literal("{")
        self.ws()
        self.literal('"name"')
        self.ws()
        self.literal(":")
        self.ws()
        call = ParsedCall(self.string(), "")
        self.ws()
        self.literal(",")
        self.ws()
        self.literal(*(f'"{key}"' for key in args_keys))
        self.ws()
        self.literal(":")
        self.ws()
        if self.at_end():
            self.more()
        if self.text[self.pos] != "{":
            raise NotACall()
        calls.append(call)
        call.arguments = self.json_object(lambda partial: setattr(call, "arguments", partial))
        self.ws()
        self.literal("}")
        call.complete = True


RegionParser = Callable[[str, bool], Region]


def scan_region(text: str, final: bool, body: Callable[[Scanner, list[ParsedCall], Region], None]) -> Region:
    """Run `body` over `text`; it appends calls and sets `region.good_end` as calls complete."""
    region = Region()
    scanner = Scanner(text, final)
    try:
        body(scanner, region.calls, region)
        region.end = scanner.pos
    except NeedMore:
        pass
    except NotACall:
        region.failed = True
    return region


class ToolCallParser:
    """Text chunks in, `Event`s out, for one choice.

    `trigger` opens a region (or any of several: Llama's `<|python_tag|>` or a bare `{"name"`);
    `at_start_only` formats (the pythonic list) only look for it at the start of the answer;
    `forced` regions start at once (a call is the whole answer). Whitespace and `separators`
    between calls are dropped."""

    def __init__(self, trigger: str | tuple[str, ...], parse_region: RegionParser, *, at_start_only: bool = False,
                 forced: bool = False, separators: str = "") -> None:
        self._triggers = (trigger,) if isinstance(trigger, str) else tuple(trigger)
        self._trigger = self._triggers[0]  # the one that opened the open region
        self._parse = parse_region
        self._at_start_only = at_start_only
        self._forced = forced
        self._separators = " \t\r\n" + separators
        self._buf = ""
        self._in_region = forced
        self._regions_left = 1 if forced else -1
        self._seen_text = False  # any content yet (at_start_only formats stop looking after it)
        self._emitted: list[int] = []  # per call of the open region: argument characters sent
        self._num_calls = 0  # calls started in earlier regions
        self._held = ""  # separators after a call, sent only if text follows
        self.calls: list[ParsedCall] = []  # every call started, in order

    def feed(self, text: str, final: bool = False) -> list[Event]:
        """The events `text` completes; with `final`, everything left (a region that is not a
        complete call becomes text)."""
        self._buf += text
        events: list[Event] = []
        while True:
            if self._in_region:
                if not self._region_step(events, final):
                    break
            elif not self._text_step(events, final):
                break
        return events

    def _text_step(self, events: list[Event], final: bool) -> bool:
        """Pass text through up to a trigger; True when a region opened."""
        if self._regions_left == 0 or (self._at_start_only and self._seen_text):
            self._text(events, self._buf, final)
            self._buf = ""
            return False
        if self._at_start_only:
            stripped = self._buf.lstrip()
            opened = next((t for t in self._triggers if stripped.startswith(t)), None)
            if opened is not None:
                self._buf, self._trigger = stripped, opened
                self._in_region = True
                return True
            if not final and any(t.startswith(stripped) for t in self._triggers):
                return False  # still undecided
            self._seen_text = True
            return True
        hits = [(k, -len(t), t) for t in self._triggers if (k := self._buf.find(t)) >= 0]
        if hits:
            k, _, self._trigger = min(hits)  # the first; of two at one place, the longer
            self._text(events, self._buf[:k], final)
            self._held = ""  # separators between two calls
            self._buf = self._buf[k:]
            self._in_region = True
            return True
        keep = 0 if final else max(_prefix_overlap(self._buf, t) for t in self._triggers)
        self._text(events, self._buf[:len(self._buf) - keep], final)
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _text(self, events: list[Event], text: str, final: bool) -> None:
        """Content, except separators right after a call (held until other text follows)."""
        if self.calls and not (self._held + text).strip(self._separators):
            self._held = "" if final else self._held + text
            return
        text, self._held = self._held + text, ""
        if text:
            self._seen_text = self._seen_text or bool(text.strip())
            if events and isinstance(events[-1], TextEvent):
                events[-1].text += text
            else:
                events.append(TextEvent(text))

    def _region_step(self, events: list[Event], final: bool) -> bool:
        """Re-read the open region; True when it closed (the text after it is read next)."""
        region = self._parse(self._buf, final)
        for j, call in enumerate(region.calls):
            if j == len(self._emitted):
                if not call.complete and region.failed:
                    break  # never started and it will not complete: it is text (below)
                self.calls.append(call)
                self._emitted.append(0)
                events.append(CallStartEvent(self._num_calls + j, call.name))
            else:
                self.calls[self._num_calls + j] = call
            if len(call.arguments) > self._emitted[j]:
                events.append(ArgumentsEvent(self._num_calls + j, call.arguments[self._emitted[j]:]))
                self._emitted[j] = len(call.arguments)
        if region.end is None and not region.failed:
            return False
        new_calls = self.calls[self._num_calls:]
        self._num_calls = len(self.calls)
        self._emitted = []
        self._in_region = False
        if self._regions_left > 0:
            self._regions_left -= 1
        if not region.failed:
            self._buf = self._buf[region.end:]
            return True
        self._seen_text = True  # an at-start format does not look again
        if any(not c.complete for c in new_calls):
            # A call already sent in part (a stream cut inside it) cannot be taken back; what is
            # left of it is dropped rather than sent a second time as text.
            self._buf = ""
            return False
        # Text from the end of the last complete call on (or from the trigger's end, when no
        # call started) is content, searched again for a trigger.
        cut = region.good_end if new_calls else len(self._trigger)
        if not new_calls:
            self._text(events, self._buf[:cut], final)
        self._buf = self._buf[cut:]
        return True


def _prefix_overlap(text: str, trigger: str) -> int:
    """Length of the longest end of `text` that begins `trigger`."""
    for k in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-k:]):
            return k
    return 0
