"""The replica picker HAProxy consults for each request when several engine replicas serve one
endpoint (Ray Serve's ingress request router): prefix-aware routing with no Python process on
the token path.

HAProxy's Lua action posts the head of each request's body to `POST /internal/route` here; this
deployment tokenizes it exactly as the replica will (`OpenAIServing.routing_prompt`: the
completions prompt, or the chat template over the messages, and the LoRA adapter its `model`
names) and asks the engine deployment's
request router (`service.routing.router.PrefixAwareRouter`) for a replica without dispatching anything;
HAProxy then forwards the request straight to that replica's own HTTP port and streams the
answer back. One call per request, none per token. A body that is not a valid request (or is
too large for HAProxy to pass on whole) is routed by load alone; the replica answers its error.

A multi-model app served as one deployment (service/app/multi.py) has it too: it reads the
body's `model`, resolves it to a served model (`ModelNames`: adapters and `<served>:<adapter>`
included) and picks among that model's replicas only, by prefix where that model has several
replicas and a prefix cache. A request without `model` goes to the first model's replicas; an
unknown `model` or an unreadable body to any replica, whose edge answers the 404 or 400.
"""

# No `from __future__ import annotations`: FastAPI must see `Request` as a class in the routes.

import asyncio
import dataclasses
import logging
import time
from collections import deque
from typing import Any

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError
from starlette.responses import JSONResponse

from service.engine.metrics import METRICS
from service.http.engine_call import OverloadPolicy
from service.openai.serving import OpenAIServing
from service.routing.model_names import UNREADABLE, ModelNames, ServedModel, body_model
from service.routing.router import RoutingPrompt, ToModel

logger = logging.getLogger(__name__)

# How long a pick may wait for a replica of the model (HAProxy gives the router 5 s by default).
PICK_TIMEOUT_S = 4.0
# The longest the KV index may take to say who holds a prompt (the pick's own budget is PICK_TIMEOUT_S).
INDEX_TIMEOUT_S = 0.25
# How many of the latest picks `recent_picks` keeps.
PICKS_KEPT = 1000

route_api = FastAPI(docs_url=None, redoc_url=None)


@serve.deployment(name="PrefixRoute")
@serve.ingress(route_api)
class PrefixRoute:
    """Answers HAProxy's `/internal/route` with the engine replica to send a request to."""

    async def __init__(self, engine: Any, models: list[ServedModel] | None = None,
                       by_prefix: list[str] | None = None, kv_index: Any = None) -> None:
        """`models`: a multi-model deployment's served models, in the app's order (None: one model);
        `by_prefix`: those of them whose requests are routed by prompt prefix (tokenized here); the
        others by adapter and load. `kv_index`: a handle to the app's `KVIndex` deployment, asked
        which replicas hold each prompt's leading blocks (None: the router's own record)."""
        self._engine = engine
        self._kv_index = kv_index
        self.index_misses = 0  # lookups that failed or timed out (routed without the index)
        self._names = ModelNames(models) if models else None
        self._serving: dict[str | None, OpenAIServing] = {}  # tokenizer and chat template, per model routed by prefix
        if self._names is None:
            info = await engine.model_info.remote()
            self._serving[None] = OpenAIServing(info, None, OverloadPolicy())
            first_model = info.served_model_name
        else:
            for name in by_prefix or ():
                info = await engine.model_info.remote(ToModel(name))
                self._serving[name] = OpenAIServing(info, None, OverloadPolicy())
            first_model = models[0].name
        specs = {spec.attr: spec for spec in METRICS}
        self._pick_time = specs["router_pick_time"].register(first_model)
        self._lookup_time = specs["router_index_lookup_time"].register(first_model)
        self.routed = 0  # requests answered with a replica
        self._picks: deque[dict[str, Any]] = deque(maxlen=PICKS_KEPT)  # the router's latest decisions
        # The handle's first pick waits for Serve to tell it the replicas, which can outlast
        # HAProxy's patience with the router (it then balances by itself): wait here instead.
        async with engine.choose_replica(_reserve=False):
            pass

    def routing_argument(self, body: bytes) -> RoutingPrompt | None:
        """What the request router picks this request's replica by (None: load alone, any replica)."""
        if self._names is None:
            routed = self._serving[None].routing_prompt(body) if body else None
            return RoutingPrompt(*routed) if routed else None
        model = body_model(body)
        target = None if model is UNREADABLE else self._names.target(model)
        if target is None:  # unreadable, or a model not served here: any replica's edge answers the error
            return None
        serving = self._serving.get(target)  # tokenized only where that model routes by prefix
        routed = serving.routing_prompt(body) if serving is not None else None
        lora = model if isinstance(model, str) and model != target else None
        return RoutingPrompt(routed[0] if routed else [], lora, target)

    @route_api.post("/internal/route")
    async def route(self, request: Request) -> Any:
        t0 = time.perf_counter()
        body = await request.body()
        argument = self.routing_argument(body)
        if argument is not None and self._kv_index is not None and argument.prompt_token_ids:
            argument = dataclasses.replace(argument, held=await self._held(argument))  # picked_by: the same list
        args = (argument,) if argument is not None else ()

        async def pick() -> tuple[tuple[str, int] | None, str]:
            async with self._engine.choose_replica(*args, _reserve=False) as selection:
                replica = selection._replica  # Ray Serve LLM's direct streaming reads it the same way
                replica_id = replica.replica_id.to_full_id_str()
                self._record_pick(argument, replica_id)
                return replica.backend_http_endpoint, replica_id

        try:
            endpoint, replica_id = await asyncio.wait_for(pick(), PICK_TIMEOUT_S)
        except DeploymentUnavailableError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=503)
        except asyncio.TimeoutError:  # no replica of the model is running (starting, or being replaced)
            what = f"of the model {argument.model!r} " if argument is not None and argument.model else ""
            return JSONResponse({"detail": f"no replica {what}could take the request within {PICK_TIMEOUT_S:g} s"},
                                status_code=503)
        if endpoint is None:
            return JSONResponse({"detail": f"replica {replica_id} has no HTTP endpoint"}, status_code=503)
        host, port = endpoint
        self.routed += 1
        self._pick_time.observe(time.perf_counter() - t0)
        return {"host": host, "port": port, "replica_id": replica_id}

    async def _held(self, argument: RoutingPrompt) -> dict[str, int] | None:
        """The KV index's answer for the prompt, or None when it does not answer within
        INDEX_TIMEOUT_S (starting, restarting, overloaded): routed as without an index."""
        t0 = time.perf_counter()
        try:
            return await asyncio.wait_for(self._kv_index.lookup.remote(argument.prompt_token_ids, argument.lora),
                                          INDEX_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 (a routing hint: the request goes on without it)
            self.index_misses += 1
            if self.index_misses in (1, 10) or self.index_misses % 1000 == 0:
                logger.warning("the KV index did not answer (%d times): %s", self.index_misses, type(exc).__name__)
            return None
        finally:
            self._lookup_time.observe(time.perf_counter() - t0)

    @route_api.get("/health")
    async def health(self) -> Any:
        return {"status": "ok"}

    def routed_requests(self) -> int:
        """How many requests HAProxy has had routed here (tests wait for the first)."""
        return self.routed

    def _record_pick(self, argument: RoutingPrompt | None, replica_id: str) -> None:
        # A pick-only call takes the router's first choice as it is (no queue-length probe), so
        # this is the router's decision, even where HAProxy gave up waiting and balanced by itself.
        # No argument: the router balanced by load; an argument it left unmarked: None.
        why = "load" if argument is None else (argument.picked_by[-1] if argument.picked_by else None)
        self._picks.append({"model": argument.model if argument is not None else None,
                            "lora": argument.lora if argument is not None else None,
                            "replica_id": replica_id, "why": why})

    async def recent_picks(self) -> list[dict[str, Any]]:
        """The latest `PICKS_KEPT` decisions, oldest first (tests, debugging): each request's served
        model and adapter, the replica the router chose and why: "prefix" (the replica that
        computed its leading blocks), "adapter" (a replica holding its adapter) or "load". On the
        event loop, where the picks are appended."""
        return list(self._picks)
