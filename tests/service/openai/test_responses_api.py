"""The OpenAI Responses API (`/v1/responses`) with the official `openai` client, unchanged.

First over the real HTTP edge with a stub engine that replays a fixed answer (no Ray): the
output items, the typed stream events the client's `responses.stream()` accumulates, the
conversation a Responses request becomes (the prompt equals the equivalent chat request's),
the store and the error shapes. Then (slow) against a real Ray Serve with a tiny random
Qwen3-style model: stream equals non-stream, a two-turn conversation, a forced function call
round trip, JSON-schema output and `max_output_tokens`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.support.chat_tokenizers import generation_eos_ids, write_chat_tokenizer
from tests.support.in_process import edge_app
from tests.support.ingress_stub import stub_ingress
from tests.support.local_serve import SharedServe
from model.loading.tokenizer import HFTokenizer
from service.openai.responses_store import ResponseStore
from tests.support.tiny_models import write_tiny_llama

MODEL = "tiny-qwen3"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": WEATHER, "strict": True}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


# ---- the HTTP edge over a stub engine ------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_tokenizer(tmp_path_factory.mktemp("qwen3tok"), "qwen3")


@pytest.fixture()
def edge(qwen3_dir: Path) -> Any:
    """(openai client, stub engine, tokenizer): the real edge serving MODEL with Qwen3's template
    (Hermes tool calls, <think> reasoning); `engine.reply` is what every request answers."""
    tok = HFTokenizer(qwen3_dir)
    test_client, engine, _ = stub_ingress(tok, name=MODEL, max_model_len=4096)
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=test_client,
                           max_retries=0)
    return client, engine, tok, test_client


def _reply(edge: Any, text: str) -> None:
    _, engine, tok, _ = edge
    engine.reply = tok.encode(text, add_special_tokens=False)


def _without_ids(output: list[Any]) -> list[dict[str, Any]]:
    """Output items without their ids (new per request) and the client's own parsed fields."""
    dropped = ("id", "call_id", "parsed_arguments")
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k not in dropped} for item in output]


def test_reasoning_and_text_items_and_their_stream(edge: Any) -> None:
    client = edge[0]
    _reply(edge, "<think>two and two</think>\n\nIt is 4.")
    resp = client.responses.create(model=MODEL, input="2+2?", max_output_tokens=100)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.status == "completed"
    reasoning, message = resp.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [c.text for c in reasoning.content] == ["two and two"]
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert resp.output_text == "It is 4." and message.content[0].annotations == []
    assert resp.usage.output_tokens_details.reasoning_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.parallel_tool_calls is True and resp.tool_choice == "auto" and resp.tools == []

    with client.responses.stream(model=MODEL, input="2+2?", max_output_tokens=100) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.completed" and kinds.count("response.output_item.done") == 2
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It is 4."
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "two and two"
    assert _without_ids(final.output) == _without_ids(resp.output) and final.usage == resp.usage
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {item.id for item in final.output}


def test_function_call_items_and_streamed_arguments(edge: Any) -> None:
    client = edge[0]
    _reply(edge, CALL)
    resp = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, max_output_tokens=200)
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2} and call.call_id.startswith("call_")
    assert resp.tools[0].name == "get_weather" and resp.tools[0].parameters == WEATHER
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=TOOLS,
                                 max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris", "days": 2}
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == "".join(pieces)
    assert _without_ids(final.output) == _without_ids(resp.output)


def test_a_conversation_reaches_the_template_as_the_equivalent_chat(edge: Any) -> None:
    """instructions, an earlier turn through previous_response_id (its reasoning and call), the
    call's output: the engine gets the prompt of the same conversation sent as chat messages."""
    client, engine, _, test_client = edge
    _reply(edge, "<think>look it up</think>\n\n" + CALL)
    first = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Weather in Paris?"}],
                                    instructions="Be brief.", tools=TOOLS, max_output_tokens=200)
    call = first.output[-1]
    _reply(edge, "Sunny.")
    second = client.responses.create(model=MODEL, previous_response_id=first.id, instructions="Be brief.",
                                     tools=TOOLS, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                          "output": "sunny, 21 C"}], max_output_tokens=50)
    assert second.output_text == "Sunny." and second.previous_response_id == first.id
    responses_prompt = engine.calls[-1][0].prompt_token_ids
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "reasoning_content": "look it up",
                 "tool_calls": [{"id": call.call_id, "type": "function",
                                 "function": {"name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    r = test_client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": chat_tools})
    assert r.status_code == 200, r.text
    assert engine.calls[-1][0].prompt_token_ids == responses_prompt
    assert second.usage.input_tokens == len(responses_prompt) > first.usage.input_tokens


@pytest.mark.parametrize("reply", ["<think>hm</think>\n\nIt is 4.", CALL, "Text, then a call.\n" + CALL, None])
def test_every_body_and_stream_event_validates_against_the_client_models(edge: Any, reply: str | None) -> None:
    """Strict validation with the `openai` package's own pydantic models (the client itself
    builds them without validating); each `event:` line names its data's type. A reply of None:
    the stub's answer is cut by the length limit."""
    if reply is not None:
        _reply(edge, reply)
    body = {"model": MODEL, "input": "hi", "tools": TOOLS}
    r = edge[3].post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    resp = Response.model_validate(r.json())
    assert resp.status == ("incomplete" if reply is None else "completed")
    if reply is None:
        assert resp.incomplete_details.reason == "max_output_tokens"
    with edge[3].stream("POST", "/v1/responses", json=body | {"stream": True}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in s.read().decode().split("\n\n") if b]
    adapter = TypeAdapter(ResponseStreamEvent)
    events = []
    for block in blocks:
        name, data = block.split("\n")
        event = adapter.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        events.append(event)
    assert events[-1].type == ("response.incomplete" if reply is None else "response.completed")
    assert _without_ids(events[-1].response.output) == _without_ids(resp.output)


def test_store_retrieve_delete_and_store_false(edge: Any) -> None:
    client = edge[0]
    _reply(edge, "Hello.")
    resp = client.responses.create(model=MODEL, input="hi", metadata={"k": "v"}, user="u1")
    got = client.responses.retrieve(resp.id)
    assert got.model_dump() == resp.model_dump() and got.metadata == {"k": "v"} and got.user == "u1"
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(resp.id)
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)
    unstored = client.responses.create(model=MODEL, input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="again", previous_response_id=unstored.id)
    assert info.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": []}, "input"),
])
def test_bad_requests_are_400_naming_the_field(edge: Any, body: dict[str, Any], param: str) -> None:
    r = edge[3].post("/v1/responses", json={"model": MODEL} | body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and param in error["message"]


def test_unknown_model_is_404_and_hosted_default_tools_are_ignored(edge: Any) -> None:
    client = edge[0]
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="other", input="hi")
    assert info.value.body["param"] == "model"
    _reply(edge, "Hi.")
    resp = client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}],
                                   reasoning={"effort": "low"}, include=["reasoning.encrypted_content"])
    assert resp.output_text == "Hi." and resp.tools == [] and resp.reasoning.effort == "low"


def test_reasoning_effort_none_turns_hybrid_thinking_off(edge: Any) -> None:
    client, engine, tok, _ = edge
    _reply(edge, "Hi.")
    client.responses.create(model=MODEL, input="hi", reasoning={"effort": "none"})
    assert tok.decode(engine.calls[-1][0].prompt_token_ids).endswith("<think>\n\n</think>\n\n")
    client.responses.create(model=MODEL, input="hi", reasoning={"effort": "high"})
    assert "</think>" not in tok.decode(engine.calls[-1][0].prompt_token_ids)


def test_store_is_bounded_by_count_and_bytes() -> None:
    def body(i: int, size: int = 10) -> dict[str, Any]:
        return {"id": f"resp_{i}", "output": [{"type": "message", "text": "x" * size}]}

    store = ResponseStore(max_responses=3, max_bytes=10_000)
    for i in range(5):
        store.put(body(i), [], None)
    assert len(store) == 3 and [store.get(f"resp_{i}").body["id"] for i in (2, 3, 4)]
    store.get("resp_2")  # refreshed: resp_3 is now the oldest
    store.put(body(5), [], None)
    with pytest.raises(KeyError):
        store.get("resp_3")
    big = ResponseStore(max_responses=100, max_bytes=1000)
    for i in range(5):
        big.put(body(i, 300), [], None)
    assert big.num_bytes <= 1000 and len(big) == 2
    assert not big.put(body(9, 2000), [], None)
    chained = ResponseStore()
    chained.put(body(1), [{"role": "user", "content": "a"}], None)
    chained.put(body(2), [{"role": "user", "content": "b"}], "resp_1")
    assert [i.get("content") for i in chained.conversation("resp_2")] == ["a", None, "b", None]


# ---- a real engine: in process (the edge over EngineHost), and behind Ray Serve (slow) ----------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3") / "tiny"
    write_chat_tokenizer(directory, "qwen3", vocab_size=400)
    eos = generation_eos_ids(directory, "qwen3")
    write_tiny_llama(directory, arch="qwen3", with_tokenizer=False, vocab_size=408,
                     max_position_embeddings=1024, eos_token_id=eos[0], head_dim=16)
    write_chat_tokenizer(directory, "qwen3", vocab_size=400)  # save_pretrained leaves the tokenizer alone
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return directory


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Any:
    from model.config import EngineConfig
    from model.engine.builder import build_engine

    return build_engine(str(checkpoint), EngineConfig(num_kv_blocks=256, max_num_seqs=4), device="cpu", dtype="float32")


Check = Callable[[openai.AsyncOpenAI, httpx.AsyncClient], Awaitable[None]]


def _in_process(engine: Any, check: Check) -> None:
    """Run `check` with the official async client over the HTTP edge in front of `engine`."""

    async def run() -> None:
        async with edge_app(engine, MODEL) as app, httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://edge", timeout=120) as http:
            await check(openai.AsyncOpenAI(base_url="http://edge/v1", api_key="unused", http_client=http,
                                           max_retries=0), http)

    asyncio.run(run())


async def _stream_equals_create_and_conversation_grows(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
    kwargs = {"model": MODEL, "input": "The cat sat", "temperature": 0.0, "max_output_tokens": 12,
              "reasoning": {"effort": "low"}}
    resp = await client.responses.create(**kwargs)
    assert resp.status in ("completed", "incomplete") and resp.output_text, resp
    async with client.responses.stream(**kwargs) as stream:
        events = [e async for e in stream]
    last = events[-1]
    assert last.type == ("response.completed" if resp.status == "completed" else "response.incomplete")
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens" and resp.usage.output_tokens == 12
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text
    assert _without_ids(last.response.output) == _without_ids(resp.output)
    assert last.response.usage.output_tokens == resp.usage.output_tokens
    assert (await client.responses.retrieve(resp.id)).output_text == resp.output_text

    second = await client.responses.create(model=MODEL, input="And the dog?", previous_response_id=resp.id,
                                           temperature=0.0, max_output_tokens=8)
    messages = [{"role": "user", "content": "The cat sat"}, {"role": "assistant", "content": resp.output_text},
                {"role": "user", "content": "And the dog?"}]
    tokenized = (await http.post("/tokenize", json={"model": MODEL, "messages": messages})).json()
    assert second.usage.input_tokens == tokenized["count"] > resp.usage.input_tokens
    await client.responses.delete(resp.id)
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model=MODEL, input="x", previous_response_id=resp.id)


async def _forced_function_call_round_trip(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        first = await client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS,
                                              tool_choice=choice, temperature=1.0, max_output_tokens=120,
                                              reasoning={"effort": "none"})  # no thinking: straight to the call
        calls = [item for item in first.output if item.type == "function_call"]
        assert first.status == "completed" and calls and all(c.name == "get_weather" for c in calls), first
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), WEATHER)
        outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]
        answer = await client.responses.create(model=MODEL, input=outputs, previous_response_id=first.id,
                                               tools=TOOLS, tool_choice="none", max_output_tokens=8,
                                               temperature=0.0, reasoning={"effort": "none"})
        assert answer.output and answer.output[-1].type == "message" and answer.output_text
        # tool_choice "none" leaves the tools out of the prompt: the rest is the chat of the same turns
        reasoning = "".join(c.text for item in first.output if item.type == "reasoning" for c in item.content)
        assistant = {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]} | ({"reasoning_content": reasoning} if reasoning else {})
        messages = [{"role": "user", "content": "Weather in Paris?"}, assistant,
                    *({"role": "tool", "tool_call_id": c.call_id, "content": "sunny"} for c in calls)]
        tokenized = (await http.post("/tokenize", json={"model": MODEL, "messages": messages,
                                                        "chat_template_kwargs": {"enable_thinking": False}})).json()
        assert answer.usage.input_tokens == tokenized["count"]


async def _json_schema_and_max_output_tokens(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    resp = await client.responses.create(model=MODEL, input="Yes or no?", max_output_tokens=60, temperature=1.0,
                                         text={"format": {"type": "json_schema", "name": "yn", "schema": schema,
                                                          "strict": True}})
    assert resp.status == "completed" and resp.text.format.type == "json_schema"
    jsonschema.validate(json.loads(resp.output_text), schema)
    cut = await client.responses.create(model=MODEL, input="Tell a story", max_output_tokens=3, temperature=0.0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3


CHECKS = [_stream_equals_create_and_conversation_grows, _forced_function_call_round_trip,
          _json_schema_and_max_output_tokens]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.strip("_"))
def test_real_engine(engine: Any, check: Check) -> None:
    _in_process(engine, check)


@pytest.fixture(scope="module")
def served(checkpoint: Path, shared_serve: SharedServe) -> Iterator[str]:
    args = {"model": str(checkpoint), "served_model_name": MODEL, "max_num_seqs": 8, "num_kv_blocks": 512,
            "engine_num_cpus": 1}
    with shared_serve(args) as url:
        yield url


@pytest.mark.slow
def test_through_ray_serve(served: str) -> None:
    """The same checks through Serve's HTTP path (HAProxy, the replica's own port)."""
    async def run() -> None:
        async with httpx.AsyncClient(base_url=served, timeout=120) as http:
            client = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="unused", http_client=http, max_retries=0)
            for check in CHECKS:
                await check(client, http)

    asyncio.run(run())
