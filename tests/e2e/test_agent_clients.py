"""Tool loops with the clients people use, unchanged, against a real Ray Serve on loopback: the
official `openai` client (call, tool result, answer; stream and not), the OpenAI Agents SDK,
LangChain's `ChatOpenAI.bind_tools` and pydantic-ai.

The model is a tiny random Qwen2 whose tokenizer has `<tool_call>` as one token; the server
finds the hermes format in its chat template. A random model does not choose a tool by itself,
so the calling turn forces one (tool_choice "required", a named tool, or a logit bias on
`<tool_call>`); what follows the opening tag is the model's, constrained by the server to the
tool's schema. Every framework's HTTP
traffic is recorded (an httpx event hook), so a test can show what the framework sent back.
The frameworks (dev dependencies) are imported inside their tests: each takes seconds to import."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import Field

from tests.support.chat_tokenizers import generation_eos_ids, write_chat_tokenizer
from tests.support.local_serve import SharedServe
from tests.support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen"
QUESTION = "What is the weather in Paris for the next two days?"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()]
FORECAST = "sunny, 21 C"  # what every get_weather tool returns
# Room for a whole call: the test tokenizer spends about a token per character of JSON.
MAX_TOKENS = 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The model directory and the id of its `<tool_call>` token."""
    from tokenizers import Tokenizer

    directory = tmp_path_factory.mktemp("qwen") / "tiny"
    write_chat_tokenizer(directory, "qwen2.5", vocab_size=400)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    eos = generation_eos_ids(directory, "qwen2.5")
    # The added tokens (<tool_call>, </tool_call>) come after the trained 400: the model covers them.
    vocab = tok.get_vocab_size(with_added_tokens=True)
    write_tiny_llama(directory, arch="qwen2", with_tokenizer=False, vocab_size=vocab, max_position_embeddings=1024,
                     eos_token_id=tok.token_to_id("<|im_end|>"))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return directory, tok.token_to_id("<tool_call>")


@pytest.fixture(scope="module")
def base_url(checkpoint: tuple[Path, int], shared_serve: SharedServe) -> Iterator[str]:
    # No tool_call_parser: the format comes from the chat template, as it does for users.
    args = {"model": str(checkpoint[0]), "served_model_name": MODEL, "max_num_seqs": 8, "num_kv_blocks": 256,
            "engine_num_cpus": 1}
    with shared_serve(args) as url:
        yield url


@pytest.fixture
def bias(checkpoint: tuple[Path, int]) -> dict[str, int]:
    """A logit bias that opens a call at every free-text position."""
    return {str(checkpoint[1]): 100}


class Wire:
    """The chat-completion request bodies a client sent, in order (an httpx request hook)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def record(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))

    async def arecord(self, request: httpx.Request) -> None:
        self.record(request)

    def sync_client(self) -> httpx.Client:
        return httpx.Client(timeout=120, event_hooks={"request": [self.record]})

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=120, event_hooks={"request": [self.arecord]})


def _check_round_trip(wire: Wire, calls: list[dict[str, Any]]) -> None:
    """The tool ran on a call the service made, and the next request sent its result back: the
    assistant message carries the call (same id) and a tool message answers it with the result."""
    assert calls, "the framework never ran the tool"
    for args in calls:
        jsonschema.validate(args, WEATHER)
    assert len(wire.bodies) >= 2, wire.bodies
    messages = wire.bodies[1]["messages"]
    (assistant,) = [m for m in messages if m["role"] == "assistant"]
    (call,) = assistant["tool_calls"]
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == calls[0]
    (result,) = [m for m in messages if m["role"] == "tool"]
    assert result["tool_call_id"] == call["id"] and FORECAST in str(result["content"])


# ---- the official openai client ---------------------------------------------------------------

@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_card_names_the_detected_format(client: openai.OpenAI) -> None:
    (card,) = client.models.list().data
    assert card.id == MODEL and card.model_extra["tool_call_parser"] == "hermes"


def _first_turn(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS,
            "parallel_tool_calls": False, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 5} | kw


@pytest.mark.parametrize("send_back", ["model_dump", "object"])
def test_openai_client_tool_loop(client: openai.OpenAI, bias: dict[str, int], send_back: str) -> None:
    """Call, tool result, answer, with the assistant message sent back the two ways users do:
    `model_dump(exclude_none=True)`, or the SDK's message object itself (the SDK serializes it)."""
    first = client.chat.completions.create(**_first_turn(logit_bias=bias))
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

    sent = choice.message.model_dump(exclude_none=True) if send_back == "model_dump" else choice.message
    history = [{"role": "user", "content": QUESTION}, sent,
               {"role": "tool", "tool_call_id": call.id, "content": FORECAST}]
    # The tools stay offered under auto; a negative bias keeps the random model from calling again.
    answer = client.chat.completions.create(**_first_turn(messages=history, logit_bias={k: -100 for k in bias}))
    reply = answer.choices[0]
    assert reply.finish_reason in ("stop", "length") and not reply.message.tool_calls
    assert isinstance(reply.message.content, str) and "<tool_call>" not in reply.message.content
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_openai_client_streamed_call_equals_non_streamed(client: openai.OpenAI, bias: dict[str, int]) -> None:
    (call,) = client.chat.completions.create(**_first_turn(logit_bias=bias)).choices[0].message.tool_calls
    deltas, reasons = [], []
    for chunk in client.chat.completions.create(**_first_turn(logit_bias=bias), stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            reasons.append(c.finish_reason)
    assert deltas and {d.index for d in deltas} == {0}
    head = deltas[0]
    assert head.id.startswith("call_") and head.type == "function" and head.function.name == call.function.name
    assert all(d.id is None and (d.function is None or d.function.name is None) for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas if d.function) == call.function.arguments
    assert [r for r in reasons if r] == ["tool_calls"]


# ---- OpenAI Agents SDK --------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_openai_agents_sdk_runs_a_function_tool(base_url: str, stream: bool) -> None:
    """tool_choice "required" on the first turn; the SDK resets it to auto once the tool ran
    (reset_tool_choice), and the random model answers in text."""
    import agents
    calls: list[dict[str, Any]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather forecast for a city."""
        calls.append({"city": city, "days": days})
        return FORECAST

    wire = Wire()
    api = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                             http_client=wire.async_client())
    agent = agents.Agent(name="forecaster", instructions="Answer with the forecast.", tools=[get_weather],
                         model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=api),
                         model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                             temperature=0.0, max_tokens=MAX_TOKENS))
    config = agents.RunConfig(tracing_disabled=True)

    async def run() -> Any:
        async with api:
            if not stream:
                return await agents.Runner.run(agent, QUESTION, run_config=config, max_turns=4)
            result = agents.Runner.run_streamed(agent, QUESTION, run_config=config, max_turns=4)
            async for _ in result.stream_events():
                pass
            return result

    result = asyncio.run(run())
    _check_round_trip(wire, calls)
    assert wire.bodies[0]["tool_choice"] == "required" and "tool_choice" not in wire.bodies[1]  # auto
    assert isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


# ---- LangChain --------------------------------------------------------------------------------

def test_langchain_bind_tools_round_trip(base_url: str) -> None:
    """A named tool_choice makes the call; the tool runs on LangChain's parsed call; a plain model
    (no tools) answers the history that holds the call and its result."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    calls: list[dict[str, Any]] = []

    @tool
    def get_weather(city: Literal["Paris", "Oslo"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather forecast for a city."""
        calls.append({"city": city, "days": days})
        return FORECAST

    wire = Wire()
    with wire.sync_client() as http:
        llm = ChatOpenAI(model=MODEL, base_url=f"{base_url}/v1", api_key="unused", max_retries=0, temperature=0.0,
                         max_tokens=MAX_TOKENS, http_client=http)
        history: list[Any] = [HumanMessage(QUESTION)]
        message = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False).invoke(history)
        assert isinstance(message, AIMessage) and not message.invalid_tool_calls
        (call,) = message.tool_calls
        assert call["name"] == "get_weather" and message.response_metadata["finish_reason"] == "tool_calls"
        result = get_weather.invoke(call)
        assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
        answer = llm.invoke([*history, message, result])

    _check_round_trip(wire, calls)
    assert wire.bodies[0]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert "tools" not in wire.bodies[1]
    assert isinstance(answer.content, str) and not answer.tool_calls


# ---- pydantic-ai ------------------------------------------------------------------------------

def test_pydantic_ai_agent_runs_a_tool(base_url: str, bias: dict[str, int]) -> None:
    """Per-step model settings (a callable of the run context): the first request biases the
    model into one call, the next forbids another, so the run ends with a text answer."""
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.messages import ToolCallPart, ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    calls: list[dict[str, Any]] = []

    def get_weather(city: Literal["Paris", "Oslo"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather forecast for a city."""
        calls.append({"city": city, "days": days})
        return FORECAST

    def settings(ctx: RunContext[None]) -> ModelSettings:
        first = ctx.run_step <= 1
        return ModelSettings(temperature=0.0, max_tokens=MAX_TOKENS, parallel_tool_calls=False,
                             logit_bias=bias if first else {k: -100 for k in bias})

    wire = Wire()
    api = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                             http_client=wire.async_client())
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=api))
    agent = Agent(model, tools=[get_weather], model_settings=settings, retries=0)

    async def run() -> Any:
        async with api:
            return await agent.run(QUESTION)

    result = asyncio.run(run())
    _check_round_trip(wire, calls)
    assert len(wire.bodies) == 2 and isinstance(result.output, str)
    parts = [p for m in result.all_messages() for p in m.parts]
    (call,) = [p for p in parts if isinstance(p, ToolCallPart)]
    (returned,) = [p for p in parts if isinstance(p, ToolReturnPart)]
    assert call.tool_name == "get_weather" and returned.tool_call_id == call.tool_call_id
