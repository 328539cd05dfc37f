"""Tool calls and reasoning over HTTP with the official `openai` client: a tiny random Qwen3-style
model (Hermes tool calls, `<think>` reasoning) behind a real Ray Serve on loopback, sampling at
temperature 1. A logit bias on the `<tool_call>` (or `<think>`) token makes the random model open
calls (or thinking); what follows is the model's, constrained only by the tool schemas."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from tests.support.chat_tokenizers import write_tiny_qwen3_chat
from tests.support.local_serve import SharedServe

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3"
VOCAB = 400
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 10}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3") / "tiny"
    write_tiny_qwen3_chat(directory, VOCAB)
    return directory


@pytest.fixture(scope="module")
def token_id(checkpoint: Path) -> dict[str, int]:
    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>", "<think>", "</think>")}


@pytest.fixture(scope="module")
def client(checkpoint: Path, shared_serve: SharedServe) -> Iterator[openai.OpenAI]:
    args = {"model": str(checkpoint), "served_model_name": MODEL, "max_num_seqs": 16, "num_kv_blocks": 512,
            "engine_num_cpus": 1}
    with shared_serve(args) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _bias(ids: dict[str, int], tokens: dict[str, float]) -> dict[str, Any]:
    return {"logit_bias": {str(ids[t]): v for t, v in tokens.items()}}


def _request(client: openai.OpenAI, extra: dict[str, Any], **kwargs: Any) -> Any:
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "temperature": 1.0, "max_tokens": 80} | kwargs
    return client.chat.completions.create(**body, extra_body=extra)


def _streamed(client: openai.OpenAI, extra: dict[str, Any], **kwargs: Any) -> dict[int, dict[str, Any]]:
    """Each choice of a streamed answer put together: content, reasoning, calls, finish reason;
    checks that each call's first delta carries its id, type and name and later ones do not."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in _request(client, extra, stream=True, **kwargs):
        for c in chunk.choices:
            got = out.setdefault(c.index, {"content": "", "reasoning": "", "calls": {}, "finish": None})
            got["content"] += c.delta.content or ""
            got["reasoning"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
            for tc in c.delta.tool_calls or []:
                if tc.index not in got["calls"]:
                    assert tc.id and tc.type == "function" and tc.function.name, tc
                    got["calls"][tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
                else:
                    assert tc.id is None and tc.function.name is None, tc
                    got["calls"][tc.index][2] += tc.function.arguments or ""
            got["finish"] = c.finish_reason or got["finish"]
    return out


def _calls(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_models_say_which_formats_are_in_force(client: openai.OpenAI) -> None:
    card = client.models.list().data[0].model_extra
    assert card["tool_call_parser"] == "hermes" and card["reasoning_parser"] == "think"


def test_auto_calls_validate_and_the_stream_equals_the_answer(client: openai.OpenAI, token_id: dict[str, int]) -> None:
    """Many seeds at temperature 1: every call validates against its tool's schema; the
    streamed deltas put together equal the non-streamed answer of the same seed."""
    extra = NO_THINKING | _bias(token_id, {"<tool_call>": 4.0})
    full = _request(client, extra, n=8, seed=11)
    num_calls = 0
    for choice in full.choices:
        for name, arguments in _calls(choice.message):
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            num_calls += 1
        if choice.finish_reason == "tool_calls":
            assert choice.message.tool_calls
        assert "<tool_call>" not in (choice.message.content or "") or choice.finish_reason == "length"
    assert num_calls > 0
    streamed = _streamed(client, extra, n=8, seed=11)
    for choice in full.choices:
        got = streamed[choice.index]
        assert got["content"] == (choice.message.content or "") and got["finish"] == choice.finish_reason
        complete = _calls(choice.message)
        assert [(n, a) for _, n, a in got["calls"].values()][:len(complete)] == complete


def test_parallel_calls_have_their_own_ids_and_false_caps_them_at_one(client: openai.OpenAI,
                                                                      token_id: dict[str, int]) -> None:
    extra = NO_THINKING | _bias(token_id, {"<tool_call>": 100.0})
    many = _request(client, extra, seed=3, max_tokens=160).choices[0]
    assert len(many.message.tool_calls) >= 2
    assert len({c.id for c in many.message.tool_calls}) == len(many.message.tool_calls)
    one = _request(client, extra, seed=3, parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
    jsonschema.validate(json.loads(one.message.tool_calls[0].function.arguments),
                        SCHEMAS[one.message.tool_calls[0].function.name])


def test_tool_choice_none_never_calls(client: openai.OpenAI, token_id: dict[str, int]) -> None:
    out = _request(client, NO_THINKING | _bias(token_id, {"<tool_call>": 100.0}), tool_choice="none", max_tokens=6)
    assert out.choices[0].message.tool_calls is None and "<tool_call>" in out.choices[0].message.content


def test_reasoning_comes_back_apart_and_is_counted(client: openai.OpenAI, token_id: dict[str, int]) -> None:
    extra = _bias(token_id, {"<think>": 6.0, "</think>": 6.0}) | {"logprobs": True}
    full = _request(client, extra, n=4, seed=7, tools=None, max_tokens=40)
    thought = 0
    for choice in full.choices:
        tokens = [t.token for t in choice.logprobs.content]
        reasoning = choice.message.model_extra["reasoning_content"]
        assert choice.message.model_extra["reasoning"] == reasoning
        first = next((t for t in tokens if t.strip()), "")  # the thinking may open after whitespace
        if first == "<think>":
            assert reasoning is not None
            thought += tokens.index("</think>") + 1 if "</think>" in tokens else len(tokens)
        else:
            assert reasoning is None and choice.message.content == "".join(tokens)
    assert thought > 0 and full.usage.completion_tokens_details.reasoning_tokens == thought
    streamed = _streamed(client, extra, n=4, seed=7, tools=None, max_tokens=40)
    for choice in full.choices:
        assert streamed[choice.index]["reasoning"] == (choice.message.model_extra["reasoning_content"] or "")
        assert streamed[choice.index]["content"] == choice.message.content
    off = _request(client, NO_THINKING | _bias(token_id, {"<think>": 6.0}), seed=7, tools=None, max_tokens=10)
    assert off.choices[0].message.model_extra["reasoning_content"] is None  # the prompt closed the thinking
    assert off.usage.prompt_tokens > full.usage.prompt_tokens


def test_tool_history_is_accepted_and_a_bad_one_is_a_400(client: openai.OpenAI, token_id: dict[str, int]) -> None:
    first = _request(client, NO_THINKING | _bias(token_id, {"<tool_call>": 100.0}), seed=1,
                     parallel_tool_calls=False).choices[0].message
    history = [*MESSAGES, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"}]
    answer = _request(client, NO_THINKING, messages=history, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length")
    bad = [*history[:-1], {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "x", "weird": 1}]
    with pytest.raises(openai.BadRequestError) as err:
        _request(client, NO_THINKING, messages=bad, max_tokens=8)
    assert "weird" in err.value.body["message"] and err.value.body["param"] == "messages[2]"
