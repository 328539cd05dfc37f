"""Tool-call formats: how each model family writes a call, how its output is constrained, and
which one a checkpoint uses.

Each format knows its trigger (the text that opens a call), the structural tag (xgrammar's
format language) that makes every call it opens well-formed and valid against the tool's JSON
schema, and its region parser (service/tools/parser.py). The formats:

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`
- `llama3_json` (Llama 3.1 / 3.2): `{"name": "f", "parameters": {...}}`, several joined by "; ", the
  first one after `<|python_tag|>` or not
- `mistral`: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`
- `pythonic` (Llama 3.2 / 4 pythonic templates): `[f(a=1), g(b="x")]` as the whole answer
"""

from __future__ import annotations

import ast
import json
import logging
import random
import re
import string
import uuid
from typing import Any

from model.sampling.structured import json_schema_ebnf
from service.tools.parser import NotACall, ParsedCall, Region, Scanner, ToolCallParser, scan_region

logger = logging.getLogger(__name__)

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
Tool = dict[str, Any]  # {"name", "parameters"}: an OpenAI function definition


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.get("parameters") or NO_PARAMETERS


def json_grammar(schema: dict[str, Any]) -> dict[str, Any]:
    """The structural-tag content of compact JSON valid against `schema` (a call's arguments)."""
    return {"type": "grammar", "grammar": json_schema_ebnf(schema)}


class ToolFormat:
    """One model family's tool-call syntax."""

    name = ""
    trigger = ""  # what opens a call; `triggers` when there are several
    separators = ""  # between calls, besides whitespace
    marker_tokens: tuple[str, ...] = ()  # special tokens the format writes (their text must be visible)
    at_start_only = False

    def call_tag(self, tool: Tool) -> dict[str, Any]:
        raise NotImplementedError

    def parse_region(self, text: str, final: bool) -> Region:
        raise NotImplementedError

    def structural_tag(self, tools: list[Tool], required: bool, parallel: bool) -> dict[str, Any]:
        """The constraint of an answer: free text that may open calls (`required` False), or
        calls only. At most one call unless `parallel`."""
        tags = [self.call_tag(t) for t in tools]
        if required:
            return {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                    "stop_after_first": not parallel}
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags, "stop_after_first": not parallel}

    def calls_only(self, tools: list[Tool], parallel: bool) -> dict[str, Any]:
        """Calls and nothing else (one or more)."""
        return self.structural_tag(tools, True, parallel)

    @property
    def triggers(self) -> tuple[str, ...]:
        return (self.trigger,)

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.triggers, self.parse_region, at_start_only=self.at_start_only,
                              separators=self.separators)

    def call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def check_tools(self, tools: list[Tool]) -> None:
        """ValueError when a tool cannot be called in this format."""


class HermesFormat(ToolFormat):
    name = "hermes"
    trigger = "<tool_call>"
    marker_tokens = ("<tool_call>", "</tool_call>")

    def call_tag(self, tool: Tool) -> dict[str, Any]:
        return {"type": "tag", "begin": f'<tool_call>\n{{"name": {json.dumps(tool["name"])}, "arguments": ',
                "content": json_grammar(_parameters(tool)), "end": "}\n</tool_call>"}

    def parse_region(self, text: str, final: bool) -> Region:
        def body(s: Scanner, calls: list[ParsedCall], region: Region) -> None:
            s.literal("<tool_call>")
            s.ws()
            s.json_call(calls, ("arguments", "parameters"))
            region.good_end = s.pos
            s.ws()
            s.literal("</tool_call>")
        return scan_region(text, final, body)


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1 / 3.2 write `<|python_tag|>` before a call (the templates' "ipython" mode) or
    the bare JSON: both open a call, and after `<|python_tag|>` only a call may follow."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    trigger = '{"name"'
    separators = ";"
    marker_tokens = (python_tag,)

    @property
    def triggers(self) -> tuple[str, ...]:
        return (self.python_tag, self.trigger)

    def call_tag(self, tool: Tool, prefix: str = "") -> dict[str, Any]:
        return {"type": "tag", "begin": f'{prefix}{{"name": {json.dumps(tool["name"])}, "parameters": ',
                "content": json_grammar(_parameters(tool)), "end": "}"}

    def structural_tag(self, tools: list[Tool], required: bool, parallel: bool) -> dict[str, Any]:
        if required:
            return {"type": "tags_with_separator", "tags": [self.call_tag(t) for t in tools], "separator": "; ",
                    "at_least_one": True, "stop_after_first": not parallel}
        tags = [self.call_tag(t, self.python_tag) for t in tools] + [self.call_tag(t) for t in tools]
        return {"type": "triggered_tags", "triggers": list(self.triggers), "tags": tags,
                "stop_after_first": not parallel}

    def parse_region(self, text: str, final: bool) -> Region:
        def body(s: Scanner, calls: list[ParsedCall], region: Region) -> None:
            s.peek(self.python_tag)
            s.ws()
            s.json_call(calls, ("parameters", "arguments"))
            region.good_end = s.pos
        return scan_region(text, final, body)


class MistralFormat(ToolFormat):
    name = "mistral"
    trigger = "[TOOL_CALLS]"
    marker_tokens = ("[TOOL_CALLS]",)

    def call_tag(self, tool: Tool) -> dict[str, Any]:
        return {"type": "tag", "begin": f'{{"name": {json.dumps(tool["name"])}, "arguments": ',
                "content": json_grammar(_parameters(tool)), "end": "}"}

    def calls_only(self, tools: list[Tool], parallel: bool) -> dict[str, Any]:
        calls = {"type": "tags_with_separator", "tags": [self.call_tag(t) for t in tools], "separator": ", ",
                 "at_least_one": True, "stop_after_first": not parallel}
        return {"type": "tag", "begin": "[TOOL_CALLS][", "content": calls, "end": "]"}

    def structural_tag(self, tools: list[Tool], required: bool, parallel: bool) -> dict[str, Any]:
        block = self.calls_only(tools, parallel)
        if required:
            return block
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": [block], "stop_after_first": True}

    def call_id(self) -> str:
        # Mistral's templates refuse a history whose call ids are not 9 letters and digits.
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def parse_region(self, text: str, final: bool) -> Region:
        def body(s: Scanner, calls: list[ParsedCall], region: Region) -> None:
            s.literal("[TOOL_CALLS]")
            s.ws()
            s.literal("[")
            while True:
                s.ws()
                s.json_call(calls, ("arguments",))
                region.good_end = s.pos
                s.ws()
                if s.literal(",", "]") == "]":
                    return
        return scan_region(text, final, body)


class PythonicFormat(ToolFormat):
    name = "pythonic"
    trigger = "["
    at_start_only = True

    def check_tools(self, tools: list[Tool]) -> None:
        for t in tools:
            names = [t["name"], *(_parameters(t).get("properties") or {})]
            bad = [n for n in names if not n.isidentifier()]
            if bad:
                raise ValueError(f"tool {t['name']!r}: the pythonic tool-call format needs Python identifiers as "
                                 f"function and parameter names, got {bad[0]!r}")

    def call_tag(self, tool: Tool) -> dict[str, Any]:
        return {"type": "tag", "begin": f"{tool['name']}(", "content": {"type": "grammar",
                                                                         "grammar": python_kwargs_ebnf(_parameters(tool))},
                "end": ")"}

    def calls_only(self, tools: list[Tool], parallel: bool) -> dict[str, Any]:
        calls = {"type": "tags_with_separator", "tags": [self.call_tag(t) for t in tools], "separator": ", ",
                 "at_least_one": True, "stop_after_first": not parallel}
        return {"type": "tag", "begin": "[", "content": calls, "end": "]"}

    def structural_tag(self, tools: list[Tool], required: bool, parallel: bool) -> dict[str, Any]:
        block = self.calls_only(tools, parallel)
        if required:
            return block
        # The whole answer is the list of calls, or text that does not start with "[".
        text = {"type": "sequence", "elements": [{"type": "regex", "pattern": r"[^\[\s]"}, {"type": "any_text"}]}
        return {"type": "or", "elements": [block, text, {"type": "const_string", "value": ""}]}

    def parse_region(self, text: str, final: bool) -> Region:
        def body(s: Scanner, calls: list[ParsedCall], region: Region) -> None:
            s.literal("[")
            while True:
                s.ws()
                calls.append(_python_call(s))
                region.good_end = s.pos
                s.ws()
                if s.literal(",", "]") == "]":
                    return
        return scan_region(text, final, body)


def _python_call(s: Scanner) -> ParsedCall:
    """`name(key=literal, ...)` -> a complete call with JSON arguments."""
    start, depth, quote, i = s.pos, 0, "", s.pos
    text = s.text
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                raise NotACall()
            if depth == 0 and ch == ")":
                s.pos = i + 1
                return _literal_call(text[start:s.pos])
        i += 1
    s.more()
    raise AssertionError  # unreachable: more() raises


def _literal_call(source: str) -> ParsedCall:
    try:
        node = ast.parse(source, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise NotACall()
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        if len(arguments) != len(node.keywords):
            raise NotACall()
        return ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False), complete=True)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        raise NotACall() from None


_PY_CONSTANTS = {'"true"': '"True"', '"false"': '"False"', '"null"': '"None"'}


def _python_rules(ebnf: str, prefix: str) -> str:
    """A JSON grammar's rules renamed with `prefix` (so several fit in one grammar) and its
    true/false/null literals written as Python writes them: the rest of JSON (strings, numbers,
    arrays, objects) is already a Python literal."""
    names = {line.split("::=", 1)[0].strip() for line in ebnf.splitlines() if "::=" in line}
    out, i, n = [], 0, len(ebnf)
    while i < n:
        ch = ebnf[i]
        if ch in "\"[":  # a string literal or a character class: copied as it is
            close = '"' if ch == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            token = ebnf[i:j + 1]
            out.append(_PY_CONSTANTS.get(token, token))
            i = j + 1
        elif ch.isalpha() or ch == "_":
            j = i
            while j < n and (ebnf[j].isalnum() or ebnf[j] == "_"):
                j += 1
            word = ebnf[i:j]
            out.append(prefix + word if word in names else word)
            i = j
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def python_kwargs_ebnf(schema: dict[str, Any]) -> str:
    """EBNF for `key=value, ...` keyword arguments of `schema`: its properties in their order,
    the required ones always, each value its sub-schema's JSON grammar written in Python
    (True/False/None), so the arguments are valid against the schema."""
    props = list((schema.get("properties") or {}).items())
    required = set(schema.get("required") or [])
    rules = ["root ::= first_0"]
    for i, (key, sub) in enumerate(props):
        value_ebnf = json_schema_ebnf(sub if isinstance(sub, dict) else {})
        # Lookahead assertions expect what follows JSON (",}]:"); here a ")" may follow.
        value_ebnf = re.sub(r" \(=\(.*\)\)$", "", value_ebnf, flags=re.M)
        rules += [f'kv_{i} ::= "{key}=" p{i}_root', _python_rules(value_ebnf, f"p{i}_")]
    n = len(props)
    for i in range(n + 1):
        if i == n:
            rules += [f'first_{i} ::= ""', f'rest_{i} ::= ""']
            continue
        first, rest = f"kv_{i} rest_{i + 1}", f'", " kv_{i} rest_{i + 1}'
        if props[i][0] in required:
            rules += [f"first_{i} ::= {first}", f"rest_{i} ::= {rest}"]
        else:
            rules += [f"first_{i} ::= {first} | first_{i + 1}", f"rest_{i} ::= {rest} | rest_{i + 1}"]
    return "\n".join(rules) + "\n"


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat(),
                                                      PythonicFormat())}
PARSER_CHOICES = ("auto", "none", *FORMATS)


def detect_format(template: str | None) -> ToolFormat | None:
    """The format a chat template writes calls in, when it says so unambiguously."""
    if not template:
        return None
    found = []
    if "<tool_call>" in template:
        found.append("hermes")
    if "[TOOL_CALLS]" in template:
        found.append("mistral")
    if "func_name1(" in template:
        found.append("pythonic")  # the pythonic Llama templates describe calls as [func_name1(params_name1=...)]
    elif '"parameters"' in template and ("<|python_tag|>" in template or "ipython" in template):
        found.append("llama3_json")
    if len(found) != 1:
        if found:
            logger.warning("the chat template matches several tool-call formats (%s); set tool_call_parser",
                           ", ".join(found))
        return None
    return FORMATS[found[0]]


def resolve_format(choice: str, template: str | None) -> ToolFormat | None:
    """`tool_call_parser` -> the format in force (None: tools are answered in text unless forced)."""
    if choice == "none":
        return None
    if choice == "auto":
        return detect_format(template)
    if choice not in FORMATS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSER_CHOICES)}, got {choice!r}")
    return FORMATS[choice]


class JsonCallFormat(ToolFormat):
    """No model format: a forced call is the whole answer, `{"name": ..., "arguments": {...}}`
    ("required") or the named function's arguments object (its JSON-schema constraint is
    built in service/openai/protocol.py)."""

    name = "json"

    def __init__(self, function: str | None = None) -> None:
        self._function = function

    def parse_region(self, text: str, final: bool) -> Region:
        def body(s: Scanner, calls: list[ParsedCall], region: Region) -> None:
            if self._function is None:
                s.json_call(calls, ("arguments",))
            else:
                call = ParsedCall(self._function, "")
                calls.append(call)
                call.arguments = s.json_object(lambda partial: setattr(call, "arguments", partial))
                call.complete = True
            region.good_end = s.pos
        return scan_region(text, final, body)

    def parser(self) -> ToolCallParser:
        return ToolCallParser("", self.parse_region, forced=True)

