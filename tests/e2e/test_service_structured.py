"""Structured outputs and tool calls over HTTP with the official `openai` client: a real Ray
Serve on loopback and a tiny random-weight model sampling at temperature 1.0, so only the
constraint makes the outputs parse."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.local_serve import SharedServe, write_tiny_checkpoint

pytestmark = pytest.mark.slow

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Give me a person."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
             "additionalProperties": False}}}]
N = 6  # choices per request: choice i samples with seed + i


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    mood: Literal["happy", "sad"]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory, shared_serve: SharedServe) -> Iterator[str]:
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", max_position=1024)
    args = {"model": str(ckpt), "served_model_name": MODEL, "max_num_seqs": 16, "num_kv_blocks": 512,
            "engine_num_cpus": 1}
    with shared_serve(args) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, stream: bool = False, **kw):
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 1.0, "seed": 11, "n": N} | kw
    if not stream:
        return client.chat.completions.create(**args)
    texts, reasons = [""] * args["n"], [None] * args["n"]
    calls: list[list[list[str]]] = [[] for _ in range(args["n"])]  # per choice: [name, arguments] per call
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.index == len(calls[c.index]):
                    calls[c.index].append([tc.function.name, ""])
                calls[c.index][tc.index][1] += tc.function.arguments or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    return texts, calls, reasons


def test_json_schema_outputs_validate_and_stream_equals_non_stream(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    full = _chat(client, response_format=fmt)
    texts = [c.message.content for c in full.choices]
    for choice in full.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert len(set(texts)) > 1
    streamed, _, reasons = _chat(client, stream=True, response_format=fmt)
    assert streamed == texts and reasons == ["stop"] * N


def test_json_object_and_the_parse_helper_with_a_pydantic_model(client: openai.OpenAI) -> None:
    out = _chat(client, n=2, max_tokens=120, response_format={"type": "json_object"})
    for choice in out.choices:  # unbounded structure: may be cut, but then it says so
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length"
    parsed = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=1.0,
                                           seed=5, n=N, response_format=Person)
    people = [c.message.parsed for c in parsed.choices]
    assert all(isinstance(p, Person) for p in people) and len({p.model_dump_json() for p in people}) > 1


def test_completions_regex_and_choice(client: openai.OpenAI) -> None:
    regex = r"(\+|-)?[0-9]{1,3}\.[0-9]{2} [A-Z]{3}"
    out = client.completions.create(model=MODEL, prompt="Price:", max_tokens=50, temperature=1.0, seed=3, n=N,
                                    extra_body={"structured_outputs": {"regex": regex}})
    assert all(c.finish_reason == "stop" and re.fullmatch(regex, c.text) for c in out.choices), out
    choices = ["alpha", "beta", "gamma delta"]
    out = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=50, temperature=1.0, seed=3, n=N,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.finish_reason == "stop" and c.text in choices for c in out.choices), out


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_parse_with_their_schema(client: openai.OpenAI, tool_choice) -> None:
    """The default model has no template of its own: the built-in one writes Hermes calls."""
    full = _chat(client, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    calls = []
    for choice in full.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        calls.append((call.function.name, json.loads(call.function.arguments)))
    if tool_choice != "required":
        assert {name for name, _ in calls} == {"get_weather"}
    _, streamed, reasons = _chat(client, stream=True, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    assert [(name, json.loads(arguments)) for (name, arguments), in streamed] == calls
    assert reasons == ["tool_calls"] * N


def test_required_with_parallel_calls_returns_each_call_valid(client: openai.OpenAI) -> None:
    full = _chat(client, tools=TOOLS, tool_choice="required", max_tokens=120)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in full.choices:
        assert choice.message.tool_calls and choice.finish_reason in ("tool_calls", "length")
        assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_auto_and_none_answer_in_text(client: openai.OpenAI) -> None:
    for tool_choice in ("auto", "none"):
        out = _chat(client, n=1, max_tokens=8, tools=TOOLS, tool_choice=tool_choice)
        assert out.choices[0].message.tool_calls in (None, []) and out.choices[0].finish_reason in ("stop", "length")


def test_tools_reach_a_chat_template_that_uses_them() -> None:
    from service.openai.chat_template import ChatTemplate
    from service.openai.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS[:1]})
    template = ChatTemplate("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}")
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    assert template.render(req.messages, True, tools) == "[get_weather]" + MESSAGES[0]["content"]


@pytest.mark.parametrize("body, param, text", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "nope"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", "missing"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
     "structured_outputs", "both constrain"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools",
     "both constrain"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
])
def test_bad_constraints_are_400s_naming_the_field(base_url: str, body, param, text) -> None:
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 4} | body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"] and err["type"] == "invalid_request_error"
