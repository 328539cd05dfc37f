"""The replica's own parts in the test's process: a real `Engine` on its step thread
(`EngineHost`) behind the real HTTP edge (`build_api`), no Ray. Fast enough for many requests
with the official clients over an ASGI transport. Also a recorder of what the replica's metrics
add to their counters (`recorded_counters`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from service.server.api import IngressSettings, build_api
from service.http.engine_call import OverloadPolicy
from service.openai.serving import OpenAIServing
from service.host.engine_host import EngineHost
from service.offline import batch_job as offline_batch_job


class NullMetrics(offline_batch_job.NullMetrics):
    """Stands in for `EngineMetrics` (Ray's metrics need a Ray worker), keeping what tests read."""

    def observe_lora_request(self, lora: str) -> None:
        self.lora_requests = getattr(self, "lora_requests", {})
        self.lora_requests[lora] = self.lora_requests.get(lora, 0) + 1

    def observe_embeddings(self, num_prompt_tokens: int) -> None:
        self.embedded_tokens = getattr(self, "embedded_tokens", 0) + num_prompt_tokens


def recorded_counters(metrics: Any, names: dict[str, str]) -> dict[str, list[float]]:
    """Record each increment of `metrics`' counters named by `names` (attribute -> the exported
    name it must have) instead of sending it to Ray: what `EngineMetrics.refresh` adds, by attribute."""
    calls: dict[str, list[float]] = {}
    for attr, name in names.items():
        counter = getattr(metrics, attr)
        assert counter._name == name
        counter.inc = lambda v, tags=None, attr=attr: calls.setdefault(attr, []).append(v)
    return calls


@contextlib.asynccontextmanager
async def edge_app(engine: Any, name: str, settings: IngressSettings | None = None,
                   overload: OverloadPolicy | None = None, **serving_args: Any) -> AsyncIterator[Any]:
    """The ASGI app of one replica serving `engine` as `name`; call inside the event loop that
    sends the requests. `serving_args`: OpenAIServing's tool_call_parser / reasoning_parser."""
    host = EngineHost(engine, name, metrics=NullMetrics())
    try:
        serving = OpenAIServing(host.model_info(), host, overload or OverloadPolicy(), **serving_args)
        app = build_api(serving, host.healthy, settings or IngressSettings())
        app.state.host = host  # tests read its metrics
        yield app
    finally:
        host.stop()
