"""Several base models behind one OpenAI endpoint: `build_app` with `models: [{...}, {...}]`.

    models:
      - {model: /ckpt/llama-1b, num_replicas: 2, lora_modules: {sql: /adapters/sql}}
      - {model: Qwen/Qwen2.5-0.5B-Instruct, max_num_seqs: 16}

Each entry is the argument dict a one-model `build_app` takes (validated by `AppArgs`): its own
replicas, engine knobs, admission limits and metrics under its `model_name`. A request goes to the
model its body's `model` names (a served name, one of its LoRA adapters, or `<served>:<adapter>`
for a model with lora_dynamic_path; none: the first model); `GET /v1/models` lists every model and
its adapters; an unknown `model` is the edge's 404.

Two layouts, chosen when the app is built:

- **One deployment** (the default under HAProxy): every model's replicas are replicas of one
  `EngineDeployment`, the app's ingress, so HAProxy reaches each of them directly, as in a
  one-model app. A replica serves the entry its Serve rank falls in (ranks 0..n0-1 the first
  entry's n0 replicas, and so on) and reports its model in `record_replica_metadata`. HAProxy asks
  `PrefixRoute` for each POST's replica; it reads the body's `model` and picks among that model's
  replicas only (by prefix where that model has several replicas). No Python hop on the token
  path. A GET (`/v1/models`, `/health`) reaches any replica: each lists every model's cards, asking
  one replica of each other model through a handle. A replica whose rank comes to name another
  entry (Serve reassigns ranks when it restores contiguity) fails its health check and is
  replaced, so each model keeps its replica count. It needs what one deployment can give:
  entries with the same replica resources and limits (CPUs, GPUs, tensor parallelism,
  backpressure, graceful shutdown) and no autoscaling.
- **The front** (otherwise: entries that differ in those, autoscaling, or Serve's Python proxy):
  each entry is its own `EngineBackend` deployment, and `ModelRouter`, the app's ingress, reads
  `model`, forwards the whole HTTP request to that model's deployment through a streaming handle
  (service/http/asgi_forward.py) and relays the replica's own answer byte for byte: one Python hop,
  and each SSE chunk crosses a Ray process boundary once (chunks written meanwhile travel together).

App-level arguments, given at the top level and refused inside an entry: `api_key` (one key for
the endpoint), `max_body_bytes` and `max_header_bytes` (enforced by every edge, and by the front),
`router_num_cpus` (the router's or the front's CPUs). Any other field set at the top level is a
default for every entry; `model`, `served_model_name`, `revision`, `lora_modules` and
`lora_dynamic_path` belong to an entry only. Names (served names and adapter names) must be unique
across the app.
"""

# No `from __future__ import annotations`: FastAPI must see `Request` as a class in the routes.

import asyncio
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from ray import serve
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.anthropic.routes import MESSAGES_PATH, anthropic_error_response
from service.app.args import AppArgs
from service.app.engine_app import (UNBOUNDED_ONGOING, compose_app, engine_init, engine_options, router_options,
                                    wants_prefix_router)
from service.errors import APIError
from service.http.asgi_forward import ForwardedRequest, ResponseStart
from service.http.engine_call import OverloadPolicy
from service.launch import haproxy_enabled
from service.openai.serving import OpenAIServing
from service.replica.engine_deployment import DEPLOYMENT_DEFAULTS, EngineReplica
from service.routing.model_names import UNREADABLE, ModelNames, ServedModel, body_model
from service.routing.prefix_route import PrefixRoute
from service.routing.router import RoutingPrompt, ToModel
from service.server.api import (API_KEY_ENV, MAX_DRAIN_BYTES, HeaderLimitMiddleware, IngressSettings, add_key_check,
                                build_api, error_response, key_lookup)

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


def served_model(args: AppArgs) -> ServedModel:
    return ServedModel(args.resolved_name(), tuple(args.lora_modules or ()), args.lora_dynamic_path is not None)


def build_multi_model_app(app: AppArgs) -> serve.Application:
    """The app of `app.models`: one deployment when the entries allow it, else behind the front."""
    entries = model_args(app)
    reason = why_not_one_deployment(entries)
    if reason is None:
        return one_deployment_app(app, entries)
    logger.info("multi-model app behind the ModelRouter front (a Python hop per request): %s", reason)
    return front_app(app, entries)


# Serve options that may differ between entries of one deployment: summed or maxed over them.
_PER_ENTRY = ("num_replicas", "max_ongoing_requests")


def why_not_one_deployment(entries: list[AppArgs]) -> str | None:
    """Why the entries cannot be replicas of one deployment (None: they can)."""
    if not haproxy_enabled():
        return "HAProxy is off, and Serve's Python proxy picks an ingress replica by load alone, not by model"
    first = {k: v for k, v in engine_options(entries[0]).items() if k not in _PER_ENTRY}
    for i, args in enumerate(entries):
        if args.autoscaling_config:
            return f"models[{i}] autoscales, and one deployment scales all its replicas together"
        options = {k: v for k, v in engine_options(args).items() if k not in _PER_ENTRY}
        differ = sorted(k for k in first.keys() | options.keys() if first.get(k) != options.get(k))
        if differ:
            return f"models[{i}] needs other replica options than models[0] ({', '.join(differ)})"
    return None


def one_deployment_app(app: AppArgs, entries: list[AppArgs]) -> serve.Application:
    """Every entry's replicas as replicas of one `EngineDeployment`, HAProxy asking `PrefixRoute`
    (with the app's model names) for each request's replica."""
    models = [served_model(args) for args in entries]
    names = tuple(m.name for m in models)
    options = engine_options(entries[0])
    options["num_replicas"] = sum(args.num_replicas for args in entries)
    options["max_ongoing_requests"] = max(engine_options(args)["max_ongoing_requests"] for args in entries)
    inits = []
    for args in entries:
        init = engine_init(args)
        init["settings"] = {**init["settings"], "app_models": names}
        inits.append(init)
    by_prefix = [args.resolved_name() for args in entries if wants_prefix_router(args)]
    block_sizes = {args.resolved_name(): args.block_size for args in entries}
    engine = ModelsDeployment.options(**options, **router_options(
        entries[0], route_by_prefix=any(args.enable_prefix_caching for args in entries),
        model_block_sizes=block_sizes)).bind(entries=inits, counts=[args.num_replicas for args in entries], models=models)
    logger.info("multi-model app: %s as one deployment of %d replicas (%s), HAProxy routing by model%s",
                ", ".join(names), options["num_replicas"], ", ".join(str(a.num_replicas) for a in entries),
                f"; by prefix within {', '.join(by_prefix)}" if by_prefix else "")
    router = PrefixRoute.options(ray_actor_options={"num_cpus": app.router_num_cpus})
    return engine._with_ingress_request_router(router.bind(engine, models, by_prefix))


def entry_for_rank(rank: int, counts: list[int]) -> int:
    """The entry a replica of Serve rank `rank` serves: ranks 0..counts[0]-1 the first entry, the
    next counts[1] the second, and so on; a rank past the total (more replicas than planned for a
    moment, during an update) wraps around."""
    left = rank % sum(counts)
    for i, n in enumerate(counts):
        if left < n:
            return i
        left -= n
    raise AssertionError("unreachable: left < sum(counts)")


PEER_TIMEOUT_S = 10.0  # how long a replica waits for another model's cards (GET /v1/models)
STORED_RESPONSES = "/v1/responses/"  # GET and DELETE /v1/responses/{id}: each replica's own store


class ModelReplica(EngineReplica):
    """A replica of a one-deployment multi-model app: the engine and HTTP edge of the entry its
    Serve rank names (see the module docstring)."""

    async def __init__(self, entries: list[dict[str, Any]], counts: list[int], models: list[ServedModel]) -> None:
        rank = serve.get_replica_context().rank
        self._counts = counts
        self._entry = entry_for_rank(rank.rank, counts)
        self._names = ModelNames(models)
        self._app_models = self._names.names
        self._peer_handle: Any = None  # a handle to this deployment (other models' replicas), made on first use
        logger.info("replica of rank %d serves models[%d] (%s)", rank.rank, self._entry,
                    self._app_models[self._entry])
        await super().__init__(**entries[self._entry])

    def _build_edge(self) -> Any:
        """The edge, listing every model; what `forward` reaches (a forwarded request is not forwarded again)."""
        return build_api(self._serving, self._host.healthy, self._settings, self._host.metrics.observe_response,
                         app_cards=self.app_cards, created=self._created)

    def __serve_build_asgi_app__(self) -> Any:
        return ForwardOtherModels(self._edge(), own=self._app_models[self._entry], names=self._names,
                                  max_body_bytes=self._settings.max_body_bytes, forward=self._forward_to)

    def _peers(self) -> Any:
        if self._peer_handle is None:
            context = serve.get_replica_context()
            self._peer_handle = serve.get_deployment_handle(context.deployment, context.app_name)
        return self._peer_handle

    async def _forward_to(self, model: str, request: ForwardedRequest) -> Response:
        logger.info("a request for %s reached a replica of %s: forwarded", model, self._app_models[self._entry])
        return await relay(model, self._peers().options(stream=True).forward.remote(ToModel(model), request))

    async def app_cards(self) -> list[dict[str, Any]]:
        """Every model's `/v1/models` cards in the app's order: this replica's own, and one replica
        of each other model's, asked through a handle (a model with no replica up is a 503)."""
        own = self._app_models[self._entry]
        cards: list[dict[str, Any]] = []
        for name in self._app_models:
            if name == own:
                cards.extend(self.model_cards())
                continue
            response = self._peers().model_cards.remote(ToModel(name))
            try:
                cards.extend(await asyncio.wait_for(_result(response), PEER_TIMEOUT_S))
            except Exception as exc:  # no replica of it up, or it died answering
                response.cancel()
                logger.warning("the model %s did not list its cards: %s", name, type(exc).__name__)
                raise APIError(f"The model '{name}' is not available now; retry the request.", 503,
                               "server_error", headers={"Retry-After": "1"}) from None
        return cards

    async def check_health(self) -> None:
        await super().check_health()
        rank = serve.get_replica_context().rank
        if entry_for_rank(rank.rank, self._counts) != self._entry:
            raise RuntimeError(f"this replica serves models[{self._entry}] but its rank is now {rank.rank}, which "
                               f"is models[{entry_for_rank(rank.rank, self._counts)}]'s: it is replaced")


async def _result(response: Any) -> Any:
    return await response


# A one-deployment multi-model app's engine replicas, the app's ingress (as EngineDeployment is a
# one-model app's), under the same name.
ModelsDeployment = serve.deployment(name="EngineDeployment", **DEPLOYMENT_DEFAULTS)(serve.ingress()(ModelReplica))


def front_app(app: AppArgs, entries: list[AppArgs]) -> serve.Application:
    """One `EngineBackend` deployment per entry, behind the `ModelRouter` front."""
    engines = {args.resolved_name(): compose_app(args, deployment_name=deployment_name(i, args.resolved_name()))
               for i, args in enumerate(entries)}
    routed = [args.resolved_name() for args in entries if wants_prefix_router(args, behind_front=True)]
    logger.info("multi-model app: %s behind one endpoint%s", ", ".join(engines),
                f"; picked by prefix/adapter: {', '.join(routed)}" if routed else "")
    front = ModelRouter.options(ray_actor_options={"num_cpus": app.router_num_cpus},
                                max_ongoing_requests=UNBOUNDED_ONGOING, max_queued_requests=-1)
    return front.bind(engines, [served_model(args) for args in entries], routed,
                      {"api_key": app.api_key, "max_body_bytes": app.max_body_bytes,
                       "max_header_bytes": app.max_header_bytes})


class _Relay(StreamingResponse):
    """A forwarded response: the replica's status and headers, then its body as it streams."""

    def __init__(self, start: ResponseStart, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, status_code=start.status)
        self.raw_headers = list(start.headers)


async def relay(name: str, stream: Any) -> Response:
    """The response of a `forward` handle call (`stream`) to model `name`'s replica, relayed as it
    streams; a 503 when no replica of it could take the request."""
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


class ForwardOtherModels:
    """Outermost ASGI middleware of a one-deployment replica's edge: a POST whose `model` is another
    entry's (HAProxy sent it before it knew the router, or a pin missed) is forwarded to a replica of
    that model through a handle and relayed, instead of being answered with a 404. Every other
    request (its own model, an unknown one, a body too large or unreadable) goes to the edge with
    its body as it came. A stored response (`GET`/`DELETE /v1/responses/{id}`, which names no model)
    that this replica does not hold is asked of a replica of each other model in turn, as the front
    does: the store is per replica."""

    def __init__(self, app: ASGIApp, own: str, names: ModelNames, max_body_bytes: int,
                 forward: Callable[[str, ForwardedRequest], Awaitable[Response]]) -> None:
        self.app = app
        self._own, self._names, self._max_body, self._forward = own, names, max_body_bytes, forward

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("GET", "DELETE") \
                and scope["path"].startswith(STORED_RESPONSES):
            await self._stored_response(scope, receive, send)
            return
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more and size <= self._max_body:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the edge sees it as it would have
                replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": True},
                                         message]
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
        else:
            replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": more}]
        body = b"".join(chunks)
        model = body_model(body) if not more else UNREADABLE
        target = None if model is UNREADABLE else self._names.target(model)
        if target is not None and target != self._own:
            fwd = ForwardedRequest("POST", scope["path"], scope.get("query_string", b""), list(scope["headers"]),
                                   body, scope.get("client"))
            await (await self._forward(target, fwd))(scope, receive, send)
            return

        async def replayed() -> Message:
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replayed, send)

    async def _stored_response(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer: list[Message] = []

        async def keep(message: Message) -> None:
            answer.append(message)

        await self.app(scope, receive, keep)
        if answer and answer[0].get("status") == 404:
            for other in self._names.names:
                if other == self._own:
                    continue
                fwd = ForwardedRequest(scope["method"], scope["path"], scope.get("query_string", b""),
                                       list(scope["headers"]), b"", scope.get("client"))
                response = await self._forward(other, fwd)
                if response.status_code != 404:
                    await response(scope, receive, send)
                    return
                await _discard(response)
        for message in answer:
            await send(message)


def _not_found(model: str, served: list[str], path: str) -> Response:
    err = APIError(f"The model '{model}' does not exist; this server serves {', '.join(map(repr, served))}.", 404,
                   "invalid_request_error", "model", "model_not_found")
    return anthropic_error_response(err) if path.startswith(MESSAGES_PATH) else error_response(err)


@serve.deployment(name="ModelRouter")
@serve.ingress()  # the FastAPI app is built per replica: __serve_build_asgi_app__
class ModelRouter:
    """The multi-model app's ingress: routes each request by its `model` to that model's engine
    deployment and relays the answer; see the module docstring."""

    async def __init__(self, engines: dict[str, Any], models: list[ServedModel], routed: list[str],
                       settings: dict[str, Any]) -> None:
        self._engines = {name: handle.options(stream=True) for name, handle in engines.items()}
        self._names = ModelNames(models)
        self._infos = {name: await engines[name].model_info.remote() for name in routed}
        self._plain = engines
        # Models with several replicas pick one by prompt prefix and adapter: tokenized here as there.
        self._serving = {name: OpenAIServing(self._infos[name], None, OverloadPolicy()) for name in routed}
        # The front checks keys for what it answers itself; each model's edge checks them again
        # (and runs the request as the key's tenant).
        self._keys = key_lookup(IngressSettings(api_key=settings["api_key"] or os.environ.get(API_KEY_ENV) or None,
                                                api_keys_file=settings.get("api_keys_file")))
        self._max_body = settings["max_body_bytes"]
        self._max_header = settings["max_header_bytes"]

    def target(self, model: str | None) -> str | None:
        """The served model whose deployment answers `model` (None: not served here)."""
        return self._names.target(model)

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
        return await relay(name, self._engines[name].forward.remote(route, fwd))

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

        if self._keys is not None:
            add_key_check(app, self._keys)
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
