"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`) with the official
`anthropic` client, unchanged.

Shapes (thinking blocks, tool history reaching the template, error bodies, stream event order,
the API key) are checked at the real HTTP edge over a stub engine that replays a fixed answer
(`tests/support/ingress_stub.py`); the client round trips (create, stream equals create at temperature 0,
stop sequences, count_tokens and cache reads, a forced tool call and its result) run over a real
engine with a tiny random Qwen3-style model: in this process (`EngineHost` + `build_api`, no
Ray), and once through Ray Serve.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import jsonschema
import pytest
from fastapi.testclient import TestClient

from model.loading.tokenizer import ByteTokenizer
from service.engine.engine_loop import EngineFailure
from service.server.api import IngressSettings, build_api
from tests.support.chat_tokenizers import QWEN3_TEMPLATE, write_tiny_qwen3_chat
from tests.support.in_process import edge_app
from tests.support.ingress_stub import StubEngine, stub_ingress
from tests.support.local_serve import SharedServe

MODEL = "tiny-qwen3"
VOCAB = 400
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather forecast of a city.", "input_schema": WEATHER}]
HI = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"type": "disabled"}
GREEDY = {"temperature": 0.0}  # the SDK has no sampling arguments any more: they go in the body as they are


# ---- the HTTP edge over a stub engine (no Ray) --------------------------------------------------

def _edge(reply: str, api_key: str | None = None) -> tuple[TestClient, StubEngine, ByteTokenizer]:
    """The edge serving "tiny" with the Qwen3 template (Hermes calls, `<think>` reasoning); every
    request answers `reply`, one byte per engine step."""
    tok = ByteTokenizer()
    tok.chat_template = QWEN3_TEMPLATE
    client, engine, serving = stub_ingress(tok, max_model_len=4096)
    engine.reply = tok.encode(reply, add_special_tokens=False)
    if api_key is not None:
        client = TestClient(build_api(serving, lambda: True, IngressSettings(api_key=api_key)))
    return client, engine, tok


def _sdk(client: TestClient, **auth: Any) -> anthropic.Anthropic:
    """The official client over the edge's test transport (TestClient is an httpx.Client)."""
    return anthropic.Anthropic(base_url=str(client.base_url), http_client=client, max_retries=0,
                               **(auth or {"api_key": "unused"}))


def _blocks(msg: Any) -> list[dict[str, Any]]:
    """A message's content blocks as plain dicts (streamed messages hold the SDK's parsed subclasses)."""
    return [b.model_dump(include={"type", "text", "thinking", "signature", "id", "name", "input"}) for b in msg.content]


def _sse(client: TestClient, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event of a streamed answer."""
    with client.stream("POST", "/v1/messages", json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in r.read().decode().split("\n\n") if f.strip()]
    out = []
    for frame in frames:
        event_line, data_line = frame.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        out.append((event_line[7:], json.loads(data_line[6:])))
    return out


def test_thinking_goes_to_a_thinking_block_streamed_or_not() -> None:
    client, _, _ = _edge("<think>hmm, 2+2</think>\n\nIt is 4.")
    sdk = _sdk(client)
    msg = sdk.messages.create(model="tiny", max_tokens=100, messages=[{"role": "user", "content": "2+2?"}])
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == [
        ("thinking", "hmm, 2+2"), ("text", "It is 4.")]
    assert msg.content[0].signature == "" and msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.id.startswith("msg_") and msg.model == "tiny" and msg.role == "assistant"
    with sdk.messages.stream(model="tiny", max_tokens=100, messages=[{"role": "user", "content": "2+2?"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "It is 4." and _blocks(final) == _blocks(msg) and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == msg.usage.output_tokens == len("<think>hmm, 2+2</think>\n\nIt is 4.")


def test_stream_events_come_in_anthropic_order() -> None:
    reply = '<think>ok</think>\n\nLet me look.<tool_call>\n{"name": "get_weather", "arguments": ' \
            '{"city": "Oslo", "days": 2}}\n</tool_call>'
    client, _, _ = _edge(reply)
    events = _sse(client, {"model": "tiny", "max_tokens": 500, "messages": HI, "tools": TOOLS})
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    blocks, open_index = [], None  # each block: start, its deltas, stop, before the next starts
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append([data["content_block"]])
        else:
            assert data["index"] == open_index, (name, data)
            if name == "content_block_stop":
                open_index = None
            else:
                blocks[-1].append(data["delta"])
    assert open_index is None
    kinds = [(b[0]["type"], {d["type"] for d in b[1:]}) for b in blocks]
    assert kinds == [("thinking", {"thinking_delta"}), ("text", {"text_delta"}), ("tool_use", {"input_json_delta"})]
    assert "".join(d["text"] for d in blocks[1][1:]) == "Let me look."
    call = blocks[2]
    assert call[0]["name"] == "get_weather" and call[0]["input"] == {} and call[0]["id"]
    assert json.loads("".join(d["partial_json"] for d in call[1:])) == {"city": "Oslo", "days": 2}
    assert len(call) > 3  # the arguments stream in pieces as they are written
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == len(reply)
    body = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 500, "messages": HI,
                                             "tools": TOOLS}).json()
    assert body["stop_reason"] == "tool_use" and body["content"][2]["input"] == {"city": "Oslo", "days": 2}
    assert body["content"][2]["id"] != call[0]["id"]  # one fresh id per call made


def test_tool_history_reaches_the_template() -> None:
    client, engine, tok = _edge("Sunny.")
    history = [*HI, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris", "days": 1}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "sunny, 21 C"}],
             "cache_control": {"type": "ephemeral"}}]}]
    body = {"model": "tiny", "max_tokens": 50, "system": [{"type": "text", "text": "Be brief."}],
            "messages": history, "tools": TOOLS}
    msg = _sdk(client).messages.create(**body)
    assert msg.content[0].text == "Sunny."
    prompt = tok.decode(engine.calls[-1][0].prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nBe brief.") and '"name": "get_weather"' in prompt
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>'
    assert "Checking." in prompt and call in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert "<think>\nI should call the tool.\n</think>" in prompt  # the turn in progress keeps its thinking
    count = _sdk(client).messages.count_tokens(model="tiny", messages=history, tools=TOOLS,
                                               system=[{"type": "text", "text": "Be brief."}])
    assert count.input_tokens == msg.usage.input_tokens == len(engine.calls[-1][0].prompt_token_ids)
    history[-1]["content"][0]["is_error"] = True  # a failed tool, and the user's next question
    history[-1]["content"].append({"type": "text", "text": "And tomorrow?"})
    _sdk(client).messages.create(**body)
    prompt = tok.decode(engine.calls[-1][0].prompt_token_ids)
    assert prompt.endswith("<tool_response>\nError: sunny, 21 C\n</tool_response><|im_end|>\n"
                           "<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n")
    assert "I should call the tool." not in prompt  # an earlier turn's thinking: dropped, as Qwen3 was trained


def test_thinking_disabled_closes_the_thinking_in_the_prompt() -> None:
    client, engine, tok = _edge("<think>x</think>ok")
    msg = _sdk(client).messages.create(model="tiny", max_tokens=20, messages=HI, thinking=NO_THINKING)
    assert tok.decode(engine.calls[-1][0].prompt_token_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert [b.type for b in msg.content] == ["text"]  # no thinking was asked for: the text is the answer


def test_output_format_constrains_and_harmless_fields_pass() -> None:
    client, engine, _ = _edge('{"city": "Oslo", "days": 2}')
    msg = _sdk(client).messages.create(
        model="tiny", max_tokens=50, messages=HI, output_config={"format": {"type": "json_schema", "schema": WEATHER},
                                                                 "effort": "low"},
        metadata={"user_id": "u1"}, service_tier="auto", cache_control={"type": "ephemeral"},
        system=[{"type": "text", "text": "Answer in JSON.", "cache_control": {"type": "ephemeral"}}])
    assert json.loads(msg.content[0].text) == {"city": "Oslo", "days": 2}
    (sub,) = engine.calls[-1]
    assert sub.params.json_schema == WEATHER  # the engine was told to hold the answer to the schema


def test_errors_have_anthropics_shape() -> None:
    client, engine, _ = _edge("ok")
    base = {"model": "tiny", "max_tokens": 10, "messages": HI}
    cases = [({"max_tokens": None}, 400, "max_tokens"), ({"model": "gpt-4"}, 404, "gpt-4"),
             ({"temperature": 1.5}, 400, "temperature"), ({"mcp_servers": []}, 400, "mcp_servers"),
             ({"stop_sequences": [""]}, 400, "stop_sequences"),
             ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, 400, "nope"),
             ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "image"),
             ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]}, 400,
              "tool_use_id"),
             ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, "budget_tokens")]
    for change, status, named in cases:
        body = {k: v for k, v in (base | change).items() if v is not None}
        r = client.post("/v1/messages", json=body)
        assert r.status_code == status, (change, r.text)
        out = r.json()
        assert set(out) == {"type", "error"} and out["type"] == "error", out
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        assert out["error"]["type"] == kind and named in out["error"]["message"], out
    assert client.post("/v1/messages/count_tokens", json={"model": "tiny"}).json()["error"]["message"] == \
        "messages is required"
    assert not engine.calls  # every one was turned away before the engine
    with pytest.raises(anthropic.NotFoundError) as caught:
        _sdk(client).messages.create(**base | {"model": "claude-sonnet-4-5"})
    assert caught.value.body["error"]["type"] == "not_found_error"


def test_an_error_after_the_start_is_an_error_event() -> None:
    client, engine, _ = _edge("a long answer")
    generate = engine.generate

    def failing(requests: list[Any]) -> Any:
        call = generate(requests)
        call._items.insert(3, EngineFailure(503, "The engine loop stopped."))
        return call

    engine.generate = failing
    events = _sse(client, {"model": "tiny", "max_tokens": 50, "messages": HI})
    assert [n for n, _ in events][:2] == ["message_start", "ping"] and "message_stop" not in [n for n, _ in events]
    assert events[-1] == ("error", {"type": "error", "error": {"type": "overloaded_error",
                                                              "message": "The engine loop stopped."}})


def test_the_messages_routes_take_the_api_key_as_x_api_key_or_bearer() -> None:
    client, _, _ = _edge("ok", api_key="s3cret")
    body = {"model": "tiny", "max_tokens": 5, "messages": HI}
    assert _sdk(client, api_key="s3cret").messages.create(**body).content[0].text == "ok"
    assert _sdk(client, auth_token="s3cret").messages.count_tokens(model="tiny", messages=HI).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as caught:
        _sdk(client, api_key="wrong").messages.create(**body)
    assert caught.value.status_code == 401 and caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "authentication_error"
    r = client.post("/v1/messages", json=body, headers={"x-api-key": "s3cret", "authorization": "Bearer wrong"})
    assert r.status_code == 200  # either header may carry the key
    r = client.post("/v1/chat/completions", json={"messages": HI}, headers={"x-api-key": "s3cret"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's routes: Bearer only


# ---- the official client against a real engine --------------------------------------------------
# A tiny random Qwen3-style model. The round trips run over the replica's own parts in this
# process (`EngineHost` + `build_api`, no Ray); one test runs them through Ray Serve.

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3") / "tiny"
    write_tiny_qwen3_chat(directory, VOCAB)
    return directory


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Any:
    from model.config import EngineConfig
    from model.engine.builder import build_engine

    return build_engine(str(checkpoint), EngineConfig(num_kv_blocks=256, max_num_seqs=4), device="cpu", dtype="float32")


def _served(engine: Any, check: Callable[[anthropic.AsyncAnthropic], Awaitable[None]]) -> None:
    """Run `check` with the official async client of the HTTP edge over `engine`."""

    async def run() -> None:
        async with edge_app(engine, MODEL) as app, httpx2.AsyncClient(
                transport=httpx2.ASGITransport(app), base_url="http://edge", timeout=120) as http:  # the SDK's HTTP library
            await check(anthropic.AsyncAnthropic(base_url="http://edge", api_key="unused", http_client=http,
                                                 max_retries=0))

    asyncio.run(run())


def _text(msg: Any) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


async def _create_stream_and_stop(sdk: anthropic.AsyncAnthropic) -> None:
    greedy = {"model": MODEL, "max_tokens": 24, "extra_body": GREEDY, "thinking": NO_THINKING,
              "messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}]}
    msg = await sdk.messages.create(**greedy)
    text = _text(msg)
    assert msg.stop_reason in ("max_tokens", "end_turn") and 0 < msg.usage.output_tokens <= 24
    assert msg.stop_reason == "end_turn" or msg.usage.output_tokens == 24
    assert msg.usage.cache_read_input_tokens == 0 and msg.usage.cache_creation_input_tokens == 0
    count = await sdk.messages.count_tokens(model=MODEL, messages=greedy["messages"], thinking=NO_THINKING)
    assert count.input_tokens == msg.usage.input_tokens  # nothing cached yet: the whole prompt
    async with sdk.messages.stream(**greedy) as stream:
        streamed = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert streamed == text and _text(final) == text and final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    # The same prompt again: its full blocks come from the prefix cache, counted as Anthropic counts cache reads.
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == count.input_tokens
    short = await sdk.messages.create(**greedy | {"max_tokens": 3})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    stop = text.strip()[4:7]
    assert len(stop) == 3, text  # the greedy answer, cut at a piece of itself
    cut = await sdk.messages.create(**greedy | {"stop_sequences": ["\x00never", stop]})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(cut) == text[:text.index(stop)]


def test_create_stream_count_tokens_and_stop_sequences(engine: Any) -> None:
    _served(engine, _create_stream_and_stop)


async def _tool_round_trip(sdk: anthropic.AsyncAnthropic) -> None:
    # One call each (a random model would repeat parallel calls up to max_tokens).
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}):
        body = {"model": MODEL, "max_tokens": 120, "extra_body": GREEDY, "thinking": NO_THINKING, "messages": HI,
                "tools": TOOLS, "tool_choice": choice}
        msg = await sdk.messages.create(**body)
        calls = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and len(calls) == 1, msg
        for call in calls:
            assert call.name == "get_weather" and call.id
            jsonschema.validate(call.input, WEATHER)
        async with sdk.messages.stream(**body) as stream:
            final = await stream.get_final_message()
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(c.name, c.input) for c in calls]
        assert final.stop_reason == "tool_use"
    follow_up = [*HI, {"role": "assistant", "content": msg.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                               "content": "sunny, 21 C"}]}]
    answer = await sdk.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, thinking=NO_THINKING,
                                       messages=follow_up, tools=TOOLS, tool_choice={"type": "none"})
    assert answer.stop_reason in ("max_tokens", "end_turn") and answer.usage.output_tokens > 0
    assert all(b.type == "text" for b in answer.content)
    count = await sdk.messages.count_tokens(model=MODEL, messages=follow_up, tools=TOOLS,
                                            tool_choice={"type": "none"}, thinking=NO_THINKING)
    assert count.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError) as caught:
        await sdk.messages.create(model=MODEL, max_tokens=5, messages=HI, extra_body={"temperature": 2.0})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in caught.value.body["error"]["message"]


def test_a_forced_tool_call_and_its_result_round_trip(engine: Any) -> None:
    _served(engine, _tool_round_trip)


@pytest.mark.slow
def test_the_deployed_service_answers_the_messages_api(checkpoint: Path, shared_serve: SharedServe) -> None:
    """Through Ray Serve (proxy, replica): a message, its stream, a forced call and count_tokens."""
    args = {"model": str(checkpoint), "served_model_name": MODEL, "max_num_seqs": 4, "num_kv_blocks": 256,
            "engine_num_cpus": 1}
    with shared_serve(args) as url:
        sdk = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
        greedy = {"model": MODEL, "max_tokens": 16, "extra_body": GREEDY, "thinking": NO_THINKING, "messages": HI}
        msg = sdk.messages.create(**greedy)
        with sdk.messages.stream(**greedy) as stream:
            streamed = "".join(stream.text_stream)
        assert streamed == _text(msg) and msg.stop_reason in ("max_tokens", "end_turn")
        count = sdk.messages.count_tokens(model=MODEL, messages=HI, thinking=NO_THINKING)
        assert count.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
        call = sdk.messages.create(**greedy | {"max_tokens": 120, "tools": TOOLS,
                                               "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
        assert call.stop_reason == "tool_use"
        jsonschema.validate([b for b in call.content if b.type == "tool_use"][0].input, WEATHER)
