"""The real HTTP edge (`service.server.api.build_api` over `OpenAIServing`) in front of a stand-in
engine, for tests of what the edge does (tokenizing, chat templates, defaults, routes) without
Ray or a model: every engine call is recorded and answered with one finished token per request."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from model.engine.sequence import RequestOutput, RequestTimes
from model.loading.generation_config import GenerationConfig
from service.engine.engine_loop import SubRequest
from service.engine.model_info import ModelInfo
from service.server.api import IngressSettings, build_api
from service.http.engine_call import OverloadPolicy
from service.openai.serving import OpenAIServing


class _Call:
    """One engine stream: a single batch in which every request finishes, or with a `reply`
    (token ids), one batch per token of it for every request, finishing with "stop"."""

    def __init__(self, requests: list[SubRequest], reply: list[int] | None = None, tokenizer: Any = None) -> None:
        if reply is None:
            self._items = [[RequestOutput(r.request_id, [0], "", True, "length", len(r.prompt_token_ids), 1,
                                          RequestTimes(arrival=0.0)) for r in requests]]
            return
        self._items = [[RequestOutput(r.request_id, [t], tokenizer.id_to_bytes(t).decode("utf-8"), k == len(reply),
                                      "stop" if k == len(reply) else None, len(r.prompt_token_ids), k,
                                      RequestTimes(arrival=0.0)) for r in requests]
                       for k, t in enumerate(reply, 1)]

    async def __anext__(self) -> list[RequestOutput]:
        if not self._items:
            raise StopAsyncIteration
        return self._items.pop(0)

    def cancel(self) -> None:
        self._items = []


class StubEngine:
    """Stands in for the replica's `EngineHost`; `calls` holds each call's SubRequests."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.calls: list[list[SubRequest]] = []
        self.reply: list[int] | None = None  # token ids every request answers with (ASCII text)
        self._tokenizer = tokenizer

    def generate(self, requests: list[SubRequest]) -> _Call:
        self.calls.append(requests)
        return _Call(requests, self.reply, self._tokenizer)


def stub_ingress(tokenizer: Any, name: str = "tiny", generation_config: GenerationConfig | None = None,
                 max_model_len: int = 256, **serving_args: Any) -> tuple[TestClient, StubEngine, OpenAIServing]:
    """A test client of the ingress serving `name` with `tokenizer`; the stub engine records calls.
    `serving_args`: OpenAIServing's tool_call_parser / reasoning_parser."""
    engine = StubEngine(tokenizer)
    info = ModelInfo(served_model_name=name, max_model_len=max_model_len, vocab_size=tokenizer.vocab_size,
                     num_kv_blocks=64, block_size=16, tokenizer=tokenizer,
                     generation_config=generation_config or GenerationConfig())
    serving = OpenAIServing(info, engine, OverloadPolicy(), **serving_args)
    return TestClient(build_api(serving, lambda: True, IngressSettings())), engine, serving
