"""Tool history reaches the model as the checkpoint's own template writes it: the prompt ids of a
whole agent conversation (tools, assistant calls sent as OpenAI clients send them, tool results,
a final answer, a new user turn) equal `apply_chat_template(messages, tools=tools,
add_generation_prompt=True, tokenize=True)` for templates in the styles of Qwen2.5, Qwen3,
Llama 3.1 and Mistral v0.3, on `/v1/chat/completions` and `/tokenize`; `chat_template_kwargs`
and `reasoning_content` render as transformers renders them; a message field that would change
the meaning and is not honoured is a 400 naming it. No Ray: the real HTTP edge over a stub engine."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest

from tests.support.chat_tokenizers import STYLES, write_chat_tokenizer
from tests.support.ingress_stub import stub_ingress
from model.loading.tokenizer import HFTokenizer
from tests.support.requirements import need_module

transformers = need_module("transformers")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time",
                                      "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
]
# Mistral's template refuses call ids that are not 9 characters; the others do not write them.
CALL_IDS = {"mistral": ("a1b2c3d4e", "f5g6h7i8j")}
OPENAI_IDS = ("call_Wx81kQ2", "call_Tm30pZ7")
MAX_LEN = 4096  # tool definitions make long prompts with a 400-token vocabulary

Edge = tuple[Any, Any, Any]  # (TestClient, StubEngine, HF tokenizer)


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Edge]:
    """style -> (client, engine, HF tokenizer) over one tokenizer directory per style."""
    built: dict[str, Edge] = {}

    def get(style: str) -> Edge:
        if style not in built:
            directory = write_chat_tokenizer(tmp_path_factory.mktemp(style), style)
            client, engine, _ = stub_ingress(HFTokenizer(directory), max_model_len=MAX_LEN)
            built[style] = (client, engine, transformers.AutoTokenizer.from_pretrained(directory))
        return built[style]
    return get


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A tool call as OpenAI clients send it back: arguments as JSON text."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _for_hf(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers' templates expect them: call arguments as dicts (text that
    is not a JSON object stays text)."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or []:
            try:
                parsed = json.loads(call["function"]["arguments"])
            except ValueError:
                continue
            if isinstance(parsed, dict):
                call["function"]["arguments"] = parsed
    return out


def agent_conversation(style: str, ends_after_results: bool) -> list[dict[str, Any]]:
    """system, user, the assistant's calls (two in parallel; one per turn for Llama 3.1, whose
    template refuses more), their results (one with `name`), then a final answer and a new user
    turn unless the conversation ends after the results."""
    weather_id, time_id = CALL_IDS.get(style, OPENAI_IDS)
    weather = _call(weather_id, "get_weather", {"city": "Paris"})
    clock = _call(time_id, "get_time", {"tz": "Europe/Paris"})
    weather_result = {"role": "tool", "tool_call_id": weather_id, "content": '{"temperature": 21, "sky": "clear"}'}
    time_result = {"role": "tool", "tool_call_id": time_id, "name": "get_time", "content": "14:05"}
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "Weather and time in Paris?"}]
    if style == "llama3":
        messages += [{"role": "assistant", "content": None, "tool_calls": [weather]}, weather_result,
                     {"role": "assistant", "content": None, "tool_calls": [clock]}, time_result]
    else:
        messages += [{"role": "assistant", "content": None, "tool_calls": [weather, clock]}, weather_result,
                     time_result]
    if not ends_after_results:
        messages += [{"role": "assistant", "content": "Clear, 21 C; it is 14:05."},
                     {"role": "user", "content": "Thanks! And tomorrow?"}]
    return messages


def _hf_ids(hf: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    out = hf.apply_chat_template(_for_hf(messages), add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _prompt_ids(client: Any, engine: Any, body: dict[str, Any]) -> list[int]:
    """The ids the engine got for a chat request; `/tokenize` must give the same."""
    r = client.post("/v1/chat/completions", json=body | {"max_tokens": 1})
    assert r.status_code == 200, r.text
    (sub,) = engine.calls[-1]
    assert r.json()["usage"]["prompt_tokens"] == len(sub.prompt_token_ids)
    tokenized = client.post("/tokenize", json=body)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == sub.prompt_token_ids
    return sub.prompt_token_ids


@pytest.mark.parametrize("ends_after_results", [True, False], ids=["ends-after-results", "next-user-turn"])
@pytest.mark.parametrize("style", sorted(s for s in STYLES if STYLES[s].get("tools", True)))
def test_agent_conversation_prompt_equals_apply_chat_template(edge: Callable[[str], Edge], style: str,
                                                               ends_after_results: bool) -> None:
    client, engine, hf = edge(style)
    messages = agent_conversation(style, ends_after_results)
    want = _hf_ids(hf, messages, tools=TOOLS)
    got = _prompt_ids(client, engine, {"messages": messages, "tools": TOOLS})
    assert got == want, (style, hf.decode(want), hf.decode(got))
    text = hf.decode(want)
    # The history is in the prompt (a template that dropped it would match HF and prove nothing).
    for part in ("get_weather", "The local time", "Europe/Paris", "14:05", "clear"):
        assert part in text, (style, part)
    without_tools = _hf_ids(hf, messages)
    assert _prompt_ids(client, engine, {"messages": messages}) == without_tools != want


def test_llama3_refuses_parallel_calls_as_its_template_does(edge: Callable[[str], Edge]) -> None:
    client, engine, hf = edge("llama3")
    messages = agent_conversation("qwen2.5", ends_after_results=True)  # two calls in one turn
    with pytest.raises(jinja2.exceptions.TemplateError, match="single tool-calls"):
        _hf_ids(hf, messages, tools=TOOLS)
    before = len(engine.calls)
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 1})
    _assert_error(r, "messages", "single tool-calls")
    assert len(engine.calls) == before


def test_mistral_refuses_call_ids_that_are_not_nine_characters(edge: Callable[[str], Edge]) -> None:
    client, _, hf = edge("mistral")
    messages = agent_conversation("mistral", ends_after_results=True)
    messages[2]["tool_calls"][0]["id"] = "call_1"
    with pytest.raises(jinja2.exceptions.TemplateError, match="length 9"):
        _hf_ids(hf, messages, tools=TOOLS)
    _assert_error(client.post("/tokenize", json={"messages": messages, "tools": TOOLS}), "messages", "length 9")


def test_llama3_builtin_tool_calls_end_with_eom(edge: Callable[[str], Edge]) -> None:
    """`chat_template_kwargs.builtin_tools` reaches the template: a built-in call is written
    `<|python_tag|>name.call(...)<|eom_id|>`, as transformers writes it."""
    client, engine, hf = edge("llama3")
    messages = [{"role": "user", "content": "Search the weather in Paris."},
                {"role": "assistant", "content": None,
                 "tool_calls": [_call("call_S1", "brave_search", {"query": "Paris weather"})]},
                {"role": "tool", "tool_call_id": "call_S1", "content": "Sunny, 21 C"}]
    kwargs = {"builtin_tools": ["brave_search"]}
    want = _hf_ids(hf, messages, tools=TOOLS, **kwargs)
    got = _prompt_ids(client, engine, {"messages": messages, "tools": TOOLS, "chat_template_kwargs": kwargs})
    assert got == want, hf.decode(got)
    python_tag, eom = hf.convert_tokens_to_ids(["<|python_tag|>", "<|eom_id|>"])
    assert python_tag in got and eom in got
    assert 'brave_search.call(query="Paris weather")' in hf.decode(got)


def test_qwen3_enable_thinking_false_as_transformers(edge: Callable[[str], Edge]) -> None:
    client, engine, hf = edge("qwen3")
    messages = agent_conversation("qwen3", ends_after_results=False)
    body = {"messages": messages, "tools": TOOLS}
    thinking = _prompt_ids(client, engine, body)
    assert thinking == _hf_ids(hf, messages, tools=TOOLS)
    off = _prompt_ids(client, engine, body | {"chat_template_kwargs": {"enable_thinking": False}})
    assert off == _hf_ids(hf, messages, tools=TOOLS, enable_thinking=False)
    empty_think = hf.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert off == thinking + empty_think


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
@pytest.mark.parametrize("ends_after_results", [True, False], ids=["kept-in-this-turn", "dropped-before-new-query"])
def test_qwen3_reasoning_content_renders_as_transformers(edge: Callable[[str], Edge], field: str,
                                                         ends_after_results: bool) -> None:
    """An assistant turn's earlier thinking (`reasoning_content`, or its alias `reasoning`) is
    written in `<think>` while the turn is after the last user query, dropped before it, as the
    template does with a dict that has `reasoning_content`."""
    client, engine, hf = edge("qwen3")
    messages = agent_conversation("qwen3", ends_after_results)
    thought = "The user wants two facts: call both tools."
    hf_messages = copy.deepcopy(messages)
    hf_messages[2]["reasoning_content"] = thought
    messages[2][field] = thought
    want = _hf_ids(hf, hf_messages, tools=TOOLS)
    got = _prompt_ids(client, engine, {"messages": messages, "tools": TOOLS})
    assert got == want, hf.decode(got)
    assert (f"<think>\n{thought}\n</think>" in hf.decode(got)) == ends_after_results


def _assert_error(r: Any, param: str, words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert words in err["message"], err


def _call_with(arguments: Any) -> dict[str, Any]:
    return {"id": "call_X1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


USER = {"role": "user", "content": "x"}
BAD_MESSAGES = {
    "unknown-field": ([{"role": "user", "content": "x", "weird": 1}], "messages[0]", "'weird'"),
    "legacy-function-call": ([USER, {"role": "assistant", "content": "y", "function_call": {"name": "f"}}],
                             "messages[1]", "'function_call'"),
    "refusal-text": ([USER, {"role": "assistant", "content": "y", "refusal": "no"}], "messages[1]", "'refusal'"),
    "tool-calls-on-user": ([USER | {"tool_calls": [_call_with("{}")]}], "messages[0]", "tool_calls"),
    "tool-call-id-on-assistant": ([USER, {"role": "assistant", "content": "y", "tool_call_id": "call_X1"}],
                                  "messages[1]", "tool_call_id"),
    "reasoning-on-user": ([USER | {"reasoning_content": "hmm"}], "messages[0]", "reasoning"),
    "arguments-not-text": ([USER, {"role": "assistant", "content": None, "tool_calls": [_call_with(3)]}],
                           "messages[1].tool_calls[0].function.arguments", "JSON object"),
    "tool-without-content": ([USER, {"role": "tool", "tool_call_id": "call_X1"}], "messages[1]", "content"),
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("case", sorted(BAD_MESSAGES))
def test_message_fields_that_are_not_honoured_are_a_400_naming_them(edge: Callable[[str], Edge], case: str,
                                                                    path: str) -> None:
    client, engine, _ = edge("qwen2.5")
    messages, param, words = BAD_MESSAGES[case]
    before = len(engine.calls)
    body = {"messages": messages, "tools": TOOLS} | ({"max_tokens": 1} if path.startswith("/v1/") else {})
    _assert_error(client.post(path, json=body), param, words)
    assert len(engine.calls) == before


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"])
def test_reserved_chat_template_kwargs_are_a_400(edge: Callable[[str], Edge], key: str, path: str) -> None:
    client, _, _ = edge("qwen3")
    body = {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False, key: None}}
    _assert_error(client.post(path, json=body), "chat_template_kwargs", repr(key))


def test_output_only_message_fields_change_nothing(edge: Callable[[str], Edge]) -> None:
    """Fields clients echo back from a response (null refusal/audio/function_call, annotations,
    a streamed call's `index`) are accepted and leave the prompt as it is without them."""
    client, engine, _ = edge("qwen2.5")
    messages = agent_conversation("qwen2.5", ends_after_results=False)
    plain = _prompt_ids(client, engine, {"messages": messages, "tools": TOOLS})
    echoed = copy.deepcopy(messages)
    echoed[2] |= {"refusal": None, "audio": None, "function_call": None, "annotations": []}
    for i, call in enumerate(echoed[2]["tool_calls"]):
        call["index"] = i
    echoed[5] |= {"refusal": None, "annotations": []}
    assert _prompt_ids(client, engine, {"messages": echoed, "tools": TOOLS}) == plain


FIELDS_TEMPLATE = ("{% for m in messages %}[{{ m.role }}|{{ m.name }}|{{ m.tool_call_id }}|{{ m.content }}"
                   "|{{ m.reasoning_content }}|{% for c in m.tool_calls or [] %}{{ c | tojson }}{% endfor %}]"
                   "{% endfor %}{{ tools | tojson }}")


def _probe_edge(directory: Path, template: str) -> Edge:
    """An edge over a Qwen3-style tokenizer whose chat template is `template`."""
    write_chat_tokenizer(directory, "qwen3")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    client, engine, _ = stub_ingress(HFTokenizer(directory), max_model_len=MAX_LEN)
    return client, engine, transformers.AutoTokenizer.from_pretrained(directory)


def test_every_message_field_reaches_the_template(tmp_path: Path) -> None:
    """A template that writes every field sees what transformers' would: `name`, `tool_call_id`,
    call ids and arguments (as objects), reasoning, tools."""
    client, engine, hf = _probe_edge(tmp_path, FIELDS_TEMPLATE)
    messages = agent_conversation("qwen3", ends_after_results=False)
    messages[2] |= {"content": "", "reasoning_content": "Both tools."}
    messages[1]["name"] = "ada"
    got = _prompt_ids(client, engine, {"messages": messages, "tools": TOOLS})
    assert got == _hf_ids(hf, messages, tools=TOOLS), hf.decode(got)
    text = hf.decode(got)
    for part in ("[user|ada|", "[tool|get_time|call_Tm30pZ7|14:05|", "|Both tools.|", '"id": "call_Wx81kQ2"',
                 '"arguments": {"city": "Paris"}'):
        assert part in text, part


# transformers 5 drops a message's None-valued keys before rendering (so `content: null` is an
# absent key, not None) and gives reasoning as `thinking` too (gpt-oss templates read that).
PROBES = {"null-content": "{% for m in messages %}{{ 'content' in m }} {{ m.content is none }};{% endfor %}",
          "thinking-alias": "{% for m in messages %}{{ m.thinking }};{% endfor %}"}


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_assistant_call_turn_reaches_the_template_as_transformers_gives_it(tmp_path: Path, probe: str) -> None:
    client, engine, hf = _probe_edge(tmp_path, PROBES[probe])
    messages = agent_conversation("qwen3", ends_after_results=True)
    messages[2]["reasoning_content"] = "Both tools."
    got = _prompt_ids(client, engine, {"messages": messages, "tools": TOOLS})
    assert hf.decode(got) == hf.decode(_hf_ids(hf, messages, tools=TOOLS))


@pytest.mark.parametrize("style,tool_parser,reasoning_parser", [
    ("qwen2.5", "hermes", None), ("qwen3", "hermes", "think"), ("llama3", "llama3_json", None),
    ("mistral", "mistral", None)])
def test_models_name_the_parsers_of_the_template(edge: Callable[[str], Edge], style: str, tool_parser: str,
                                                  reasoning_parser: str | None) -> None:
    client, _, _ = edge(style)
    (card,) = client.get("/v1/models").json()["data"]
    assert (card["tool_call_parser"], card["reasoning_parser"]) == (tool_parser, reasoning_parser)
    assert client.get(f"/v1/models/{card['id']}").json() == card


@pytest.mark.parametrize("arguments", ['{"city": ', "[1]"])
def test_arguments_that_are_not_an_object_reach_the_template_as_text(tmp_path: Path, arguments: str) -> None:
    """A call a client cut short (a stream stopped by max_tokens) is sent back as it was: the
    template gets its text, as transformers gives it, rather than the request failing."""
    client, engine, hf = _probe_edge(tmp_path, "{% for m in messages %}{% for c in m.tool_calls or [] %}"
                                               "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [_call_with(arguments)]}]
    got = _prompt_ids(client, engine, {"messages": messages})
    assert hf.decode(got) == hf.decode(_hf_ids(hf, messages)) == json.dumps(arguments)
