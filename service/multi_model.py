"""Several base models behind one OpenAI endpoint: `build_app` with `models: [{...}, {...}]`.

    models:
      - {model: /ckpt/llama-1b, num_replicas: 2, lora_modules: {sql: /adapters/sql}}
      - {model: Qwen/Qwen2.5-0.5B-Instruct, max_num_seqs: 16}

Each entry is the argument dict a one-model `build_app` takes (validated by `AppArgs`) and becomes
its own `EngineDeployment` (own replicas, admission limits, request router, metrics under its
`model_name`). In front of them sits `ModelRouter`, the app's ingress: it reads the body's
`model` (a served name, one of its LoRA adapters, or `<served>:<adapter>` for a model with
lora_dynamic_path), forwards the whole HTTP request to that model's deployment through a
streaming handle (service/http/asgi_forward.py) and streams the replica's own answer back, byte for
byte. `GET /v1/models` lists every model and its adapters; an unknown `model` is the edge's 404.
A request without `model` goes to the first model.

The cost: HAProxy's direct path reaches one ingress deployment per app, so a multi-model app has
one Python hop on the token path, the front, and each SSE chunk crosses a Ray process boundary
once (chunks written meanwhile travel together). A one-model app (no `models`) keeps the direct
path untouched.

App-level arguments, given at the top level and refused inside an entry: `api_key` (one key for
the endpoint; the front checks it on its own answers and every model's edge on the rest),
`max_body_bytes` and `max_header_bytes` (enforced by the front and by every edge),
`router_num_cpus` (the front's CPUs). Any other field set at the top level is a default for
every entry; `model`, `served_model_name`, `revision`, `lora_modules` and `lora_dynamic_path`
belong to an entry only. Names (served names and adapter names) must be unique across the app.
"""

# No `from __future__ import annotations`: FastAPI must see `Request` as a class in the routes.

import json
import logging
import os
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from ray import serve
from starlette.responses import JSONResponse, Response, StreamingResponse

from service.anthropic.routes import MESSAGES_PATH, anthropic_error_response
from service.app import UNBOUNDED_ONGOING, AppArgs, compose_app, wants_prefix_router
from service.http.api import API_KEY_ENV, MAX_DRAIN_BYTES, ApiKeyMiddleware, HeaderLimitMiddleware, error_response
from service.http.asgi_forward import ForwardedRequest, ResponseStart
from service.http.engine_call import OverloadPolicy
from service.http.errors import APIError
from service.openai.serving import OpenAIServing
from service.routing.router import RoutingPrompt

logger = logging.getLogger(__name__)

APP_LEVEL = ("api_key", "max_body_bytes", "max_header_bytes", "router_num_cpus")
ENTRY_ONLY = ("model", "served_model_name", "revision", "lora_modules", "lora_dynamic_path")


def model_args(app: AppArgs) -> list[AppArgs]:
    """Each entry of `app.models` as the `AppArgs` of one model: the top level's defaults under it,
    the app-level fields over it. ValueError for a misplaced field or a name served twice."""
    assert app.models is not None
    if not app.models:
        raise ValueError("models must list at least one model")
    misplaced = sorted(k for k in app.model_fields_set if k in ENTRY_ONLY)
    if misplaced:
        raise ValueError(f"{', '.join(misplaced)} belong(s) inside each entry of models, not at the top level")
    defaults = {k: getattr(app, k) for k in app.model_fields_set if k not in APP_LEVEL and k != "models"}
    shared = {k: getattr(app, k) for k in APP_LEVEL}
    out, names = [], {}
    for i, entry in enumerate(app.models):
        bad = sorted(k for k in entry if k in APP_LEVEL or k == "models")
        if bad:
            raise ValueError(f"models[{i}]: {', '.join(bad)} is app-level: set it at the top level")
        args = AppArgs.model_validate({**defaults, **entry, **shared})
        for name in (args.resolved_name(), *(args.lora_modules or {})):
            if name in names:
                raise ValueError(f"models[{i}]: the name {name!r} is already served by models[{names[name]}]")
            names[name] = i
        out.append(args)
    return out


def deployment_name(index: int, served_name: str) -> str:
    """A Serve deployment name for a model (Serve allows letters, digits, '-', '_' and '.')."""
    return f"EngineDeployment-{index}-{re.sub(r'[^A-Za-z0-9_.-]', '_', served_name)}"


def build_multi_model_app(app: AppArgs) -> serve.Application:
    """One `EngineDeployment` per entry of `app.models`, behind the `ModelRouter` front."""
    entries = model_args(app)
    engines = {args.resolved_name(): compose_app(args, deployment_name=deployment_name(i, args.resolved_name()))
               for i, args in enumerate(entries)}
    routed = [args.resolved_name() for args in entries if wants_prefix_router(args, behind_front=True)]
    logger.info("multi-model app: %s behind one endpoint%s", ", ".join(engines),
                f"; picked by prefix/adapter: {', '.join(routed)}" if routed else "")
    front = ModelRouter.options(ray_actor_options={"num_cpus": app.router_num_cpus},
                                max_ongoing_requests=UNBOUNDED_ONGOING, max_queued_requests=-1)
    return front.bind(engines, routed, {"api_key": app.api_key, "max_body_bytes": app.max_body_bytes,
                                        "max_header_bytes": app.max_header_bytes})


class _Relay(StreamingResponse):
    """A forwarded response: the replica's status and headers, then its body as it streams."""

    def __init__(self, start: ResponseStart, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, status_code=start.status)
        self.raw_headers = list(start.headers)


def _not_found(model: str, served: list[str], path: str) -> Response:
    err = APIError(f"The model '{model}' does not exist; this server serves {', '.join(map(repr, served))}.", 404,
                   "invalid_request_error", "model", "model_not_found")
    return anthropic_error_response(err) if path.startswith(MESSAGES_PATH) else error_response(err)


@serve.deployment(name="ModelRouter")
@serve.ingress()  # the FastAPI app is built per replica: __serve_build_asgi_app__
class ModelRouter:
    """The multi-model app's ingress: routes each request by its `model` to that model's engine
    deployment and relays the answer; see the module docstring."""

    async def __init__(self, engines: dict[str, Any], routed: list[str], settings: dict[str, Any]) -> None:
        self._engines = {name: handle.options(stream=True) for name, handle in engines.items()}
        self._infos = {name: await handle.model_info.remote() for name, handle in engines.items()}
        self._plain = engines
        # Models with several replicas pick one by prompt prefix and adapter: tokenized here as there.
        self._serving = {name: OpenAIServing(self._infos[name], None, OverloadPolicy()) for name in routed}
        self._key = settings["api_key"] or os.environ.get(API_KEY_ENV) or None
        self._max_body = settings["max_body_bytes"]
        self._max_header = settings["max_header_bytes"]

    def target(self, model: str | None) -> str | None:
        """The served model whose deployment answers `model` (None: not served here)."""
        if model is None:
            return next(iter(self._engines))
        if model in self._engines:
            return model
        for name, info in self._infos.items():
            if model in info.lora_adapters:
                return name
        base, sep, adapter = model.partition(":")
        if sep and adapter and base in self._infos and self._infos[base].lora_dynamic:
            return base
        return None

    async def _body(self, request: Request) -> bytes:
        """The body, at most `max_body_bytes` (413 past it, after reading it to its end as the edge does)."""
        body, seen = bytearray(), 0
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > MAX_DRAIN_BYTES:
                break
            if seen <= self._max_body:
                body += chunk
        if seen > self._max_body:
            raise APIError(f"The request body exceeds the limit of {self._max_body} bytes.", 413,
                           code="request_too_large")
        return bytes(body)

    async def forward(self, name: str, request: Request, body: bytes, route: Any = None) -> Response:
        """`request` answered by model `name`'s deployment, relayed as it streams."""
        fwd = ForwardedRequest(request.method, request.url.path, request.scope.get("query_string", b""),
                               list(request.scope["headers"]), body, request.scope.get("client"))
        stream = self._engines[name].forward.remote(route, fwd)
        try:
            start = await stream.__anext__()
        except Exception as exc:  # no replica, or it died before answering
            stream.cancel()
            logger.warning("model %s could not take a request: %s", name, type(exc).__name__)
            return error_response(APIError(f"The model '{name}' is not available now; retry the request.", 503,
                                           "server_error", headers={"Retry-After": "1"}))

        async def body_chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            finally:  # the client went away (or the stream ended): the replica aborts what still runs
                stream.cancel()

        return _Relay(start, body_chunks())

    async def _collect(self, name: str, request: Request, path: str) -> tuple[int, Any]:
        fwd = ForwardedRequest("GET", path, b"", list(request.scope["headers"]), b"")
        items = [item async for item in self._engines[name].forward.remote(None, fwd)]
        start, body = items[0], b"".join(items[1:])
        return start.status, json.loads(body)

    def __serve_build_asgi_app__(self) -> Any:
        app = FastAPI(title="qkv-serve", docs_url=None, redoc_url=None)

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            data = []
            for name in self._engines:  # each model's own cards: its adapters, those loaded since included
                status, body = await self._collect(name, request, "/v1/models")
                if status != 200:
                    return JSONResponse(body, status_code=status)
                data.extend(body["data"])
            return JSONResponse({"object": "list", "data": data})

        @app.get("/v1/models/{model_id:path}")
        async def model_by_id(model_id: str, request: Request) -> Response:
            name = self.target(model_id)
            if name is None:
                return _not_found(model_id, list(self._engines), request.url.path)
            return await self.forward(name, request, b"")

        @app.get("/health")
        async def health() -> Response:
            for name, handle in self._plain.items():
                try:
                    ok = await handle.healthy.remote()
                except Exception:
                    ok = False
                if not ok:
                    return error_response(APIError(f"The engine of '{name}' is not running.", 503, "server_error"))
            return JSONResponse({"status": "ok"})

        @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
        async def anything(path: str, request: Request) -> Response:
            try:
                body = await self._body(request) if request.method == "POST" else b""
            except APIError as exc:
                return error_response(exc)
            if request.method != "POST":
                return await self._first_found(request)
            try:
                model = json.loads(body).get("model") if body else None
            except (ValueError, AttributeError):  # not a JSON object: the first model's edge says why
                model = None
            name = self.target(model if isinstance(model, str) else None)
            if name is None:
                return _not_found(model, list(self._engines), request.url.path)
            route = None
            if name in self._serving:
                picked = self._serving[name].routing_prompt(body)
                route = RoutingPrompt(*picked) if picked else None
            return await self.forward(name, request, body, route)

        if self._key:
            app.add_middleware(ApiKeyMiddleware, api_key=self._key)
        app.add_middleware(HeaderLimitMiddleware, max_bytes=self._max_header)
        return app

    async def _first_found(self, request: Request) -> Response:
        """A GET or DELETE without a body (a stored response, the explorer page): the first model
        that does not answer 404."""
        names = list(self._engines)
        for name in names[:-1]:
            response = await self.forward(name, request, b"")
            if response.status_code != 404:
                return response
            await _discard(response)
        return await self.forward(names[-1], request, b"")


async def _discard(response: Response) -> None:
    if isinstance(response, StreamingResponse):
        async for _ in response.body_iterator:
            pass
