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
"""

# No `from __future__ import annotations`: FastAPI must see `Request` as a class in the routes.

import logging
from typing import Any

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError
from starlette.responses import JSONResponse

from service.http.engine_call import OverloadPolicy
from service.openai.serving import OpenAIServing
from service.routing.router import RoutingPrompt

logger = logging.getLogger(__name__)

route_api = FastAPI(docs_url=None, redoc_url=None)


@serve.deployment(name="PrefixRoute")
@serve.ingress(route_api)
class PrefixRoute:
    """Answers HAProxy's `/internal/route` with the engine replica to send a request to."""

    async def __init__(self, engine: Any) -> None:
        self._engine = engine
        info = await engine.model_info.remote()
        self._serving = OpenAIServing(info, None, OverloadPolicy())  # its tokenizer and chat template only
        self.routed = 0  # requests answered with a replica
        # The handle's first pick waits for Serve to tell it the replicas, which can outlast
        # HAProxy's patience with the router (it then balances by itself): wait here instead.
        async with engine.choose_replica(_reserve=False):
            pass

    @route_api.post("/internal/route")
    async def route(self, request: Request) -> Any:
        body = await request.body()
        routed = self._serving.routing_prompt(body) if body else None
        args = (RoutingPrompt(*routed),) if routed else ()
        try:
            async with self._engine.choose_replica(*args, _reserve=False) as selection:
                replica = selection._replica  # Ray Serve LLM's direct streaming reads it the same way
                endpoint = replica.backend_http_endpoint
                replica_id = replica.replica_id.to_full_id_str()
        except DeploymentUnavailableError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=503)
        if endpoint is None:
            return JSONResponse({"detail": f"replica {replica_id} has no HTTP endpoint"}, status_code=503)
        host, port = endpoint
        self.routed += 1
        return {"host": host, "port": port, "replica_id": replica_id}

    @route_api.get("/health")
    async def health(self) -> Any:
        return {"status": "ok"}

    def routed_requests(self) -> int:
        """How many requests HAProxy has had routed here (tests wait for the first)."""
        return self.routed
