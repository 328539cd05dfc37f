"""The HTTP edge: FastAPI routes of the OpenAI-compatible API, served by each engine replica
(`service.replica.engine_deployment.EngineDeployment`) in the engine's own process.

Bodies are read here (with a size cap, 413 past it; headers too, 431 past theirs) and validated
by the Pydantic models in `protocol.py`; every failure leaves as the OpenAI error shape, never
FastAPI's 422 body and never a stack trace. An optional API key guards every route except
`/health`; an optional deadline aborts requests that run too long (504).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from model.config import max_concurrency
from service.anthropic.routes import MESSAGES_PATH, add_messages_routes, anthropic_error_response
from service.batch.api import LOWEST_PRIORITY, BatchLoop, add_batch_routes, in_process_send
from service.batch.files import FileStore
from service.batch.runner import BatchRunner
from service.batch.storage import open_storage
from service.errors import APIError, from_validation_error
from service.explorer.attention_api import add_attention_routes
from service.http.engine_call import OverloadPolicy, watch_first_item
from service.http.event_stream import RAW_SEND, EventStream
from service.http.images import ImageLimits
from service.openai.embeddings import add_embeddings_routes
from service.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from service.openai.responses_api import add_responses_routes
from service.openai.serving import OpenAIServing
from service.tenancy.auth import KeyMiddleware, Lookup, current_tenant, keys_file, single_key
from service.tenancy.keys import KeyTable, Tenant

logger = logging.getLogger(__name__)

API_KEY_ENV = "QKV_API_KEY"
# Reachable without the API key: probes, and the explorer page (which asks the person for the key).
OPEN_PATHS = frozenset({"/health", "/explorer", "/explorer/explorer.js", "/explorer/explorer.css"})
# An oversized body is read and discarded up to this size before the 413 (see `read_model`).
MAX_DRAIN_BYTES = 64 << 20
_Model = TypeVar("_Model", bound=BaseModel)


@dataclass(frozen=True)
class IngressSettings:
    """What the HTTP edge enforces besides the request models."""

    api_key: str | None = None
    api_keys_file: str | None = None  # tenants and their hashed keys (service/tenancy/keys.py); wins over api_key
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 32 * 1024  # request line target plus every header name and value
    overload_status: int = 503
    retry_after_s: float = 1.0
    admission_capacity: int = -1  # requests one replica admits at once (service/engine/admission.py); -1: no limit
    request_timeout_s: float | None = None  # whole-request deadline; None: none
    max_attention_floats: int = 1 << 20  # the most weights one /v1/attention answer may hold
    tool_call_parser: str = "auto"  # service/tools/formats.py: auto (from the chat template), none, or a format
    reasoning_parser: str = "auto"  # service/tools/reasoning.py: auto, none, qwen3, deepseek_r1
    app_models: tuple[str, ...] = ()  # a multi-model app's served models (named in a 404); empty: one model
    # images in requests (service/http/images.py); the app arguments of the same names
    max_images_per_request: int = 8
    max_image_bytes: int = 10 << 20
    max_image_pixels: int = 4096 * 4096
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    image_fetch_timeout_s: float = 5.0
    # the Files and Batch APIs (service/batch/); the app arguments of the same names
    batch_dir: str | None = None  # None: not served
    batch_max_file_bytes: int = 200 << 20
    batch_max_lines: int = 50_000
    batch_concurrency: int = 4
    batch_offline_min_lines: int | None = None  # batches this large run as Ray Data jobs (service/offline/batch_job.py)
    batch_offline_concurrency: int = 1
    batch_offline_num_cpus: float = 1.0
    batch_offline_num_gpus: float = 0.0

    def image_limits(self) -> ImageLimits:
        return ImageLimits(self.max_images_per_request, self.max_image_bytes, self.max_image_pixels,
                           self.allowed_local_media_path, tuple(self.allowed_media_domains), self.image_fetch_timeout_s)


def edge_serving(host: Any, settings: IngressSettings, quotas: Any = None,
                 priority_scheduling: bool = False) -> OpenAIServing:
    """The API families' handlers over an engine host, as `settings` configure the edge: a
    replica's, or a batch job's engine actor's (service/offline/batch_job.py). `quotas`: the
    tenants' ledger (None: no keys file)."""
    overload = OverloadPolicy(settings.overload_status, settings.retry_after_s, settings.admission_capacity)
    return OpenAIServing(host.model_info(), host, overload, settings.request_timeout_s, settings.tool_call_parser,
                         settings.reasoning_parser, tuple(settings.app_models), quotas, priority_scheduling,
                         settings.image_limits())


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def add_key_check(app: FastAPI, lookup: Lookup, precheck: Callable[[Any], APIError | None] | None = None) -> None:
    """401 unless the request's key passes `lookup` (service/tenancy/auth.py: one key, or a keys
    file whose tenants the request then runs as; `precheck`: the quotas' early 429). The Messages
    API routes also take Anthropic's `x-api-key: <key>` and answer in Anthropic's error shape."""
    app.add_middleware(KeyMiddleware, lookup=lookup, open_paths=OPEN_PATHS, messages_path=MESSAGES_PATH,
                       error_shapes=(error_response, anthropic_error_response), precheck=precheck)


class BatchMetrics(Protocol):
    """Where the batch service reports (service/engine/metrics.py's EngineMetrics)."""

    def observe_batch_line(self, outcome: str) -> None: ...

    def set_batches(self, counts: dict[str, int]) -> None: ...


def add_batch_service(app: FastAPI, serving: OpenAIServing, settings: IngressSettings,
                      metrics: BatchMetrics | None = None, offline: Any = None) -> None:
    """The Files and Batch APIs over `settings.batch_dir`, and the loop that runs its batches here,
    each request through `app`'s own route at the lowest priority (under priority scheduling);
    `offline`: where large batches run instead (service/offline/batch_job.py's OfflineBatches)."""
    table = KeyTable(settings.api_keys_file) if settings.api_keys_file else None

    def tenant(name: str) -> Tenant | None:
        return table.tenant(name) if table is not None else None

    store = open_storage(settings.batch_dir)  # one view of the store for the files and the runner (one lease holder)
    files = FileStore(store, settings.batch_max_file_bytes, settings.batch_max_lines)
    send = in_process_send(app, tenant, LOWEST_PRIORITY if getattr(serving, "priority_scheduling", False) else None,
                           busy=lambda: serving.num_waiting() > 0)
    runner = BatchRunner(store, files, send, settings.batch_concurrency,
                         on_line=metrics.observe_batch_line if metrics is not None else None,
                         offline=offline.with_tenants(tenant) if offline is not None else None)
    loop = BatchLoop(runner, on_statuses=metrics.set_batches if metrics is not None else None)
    add_batch_routes(app, runner, loop)
    app.router.on_startup.append(loop.ensure)  # resume what a stopped replica left, without waiting for a request


def key_lookup(settings: IngressSettings) -> Lookup | None:
    """The key check `settings` ask for: a keys file, one key, or none."""
    if settings.api_keys_file:
        return keys_file(KeyTable(settings.api_keys_file))
    return single_key(settings.api_key) if settings.api_key else None


class HeaderLimitMiddleware:
    """431 when the path and headers together exceed `max_bytes`: Serve's proxy accepts any size."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self._max = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            size += sum(len(name) + len(value) + 4 for name, value in scope["headers"])  # ": " and CRLF
            if size > self._max:
                err = APIError(f"The request headers exceed the limit of {self._max} bytes.", 431,
                               code="request_header_fields_too_large")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ResponseCounter:
    """Calls `record(route, status)` as each HTTP response starts: the route template the request
    matched (`/v1/models/{model_id:path}`, a bounded set), `other` for a path that matched none.
    Outermost, so the 431s and 401s of the middlewares inside it count too; it also keeps the
    `send` it was given in the scope, where an `EventStream` writes its body past the stack
    (service/http/event_stream.py)."""

    def __init__(self, app: ASGIApp, record: Callable[[str, int], None] | None) -> None:
        self.app = app
        self._record = record

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[RAW_SEND] = send
        if self._record is None:
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")  # set by the router, on this same scope, when a route matched
                try:
                    self._record(getattr(route, "path", "other"), message["status"])
                except Exception:  # a metrics hiccup must not fail the response
                    logger.warning("recording an HTTP response failed", exc_info=True)
            await send(message)

        await self.app(scope, receive, counted)


async def read_model(request: Request, model: type[_Model], max_bytes: int) -> _Model:
    """The body parsed into `model`: 413 past `max_bytes`, 400 for malformed or invalid JSON.

    An oversized body is still read to its end (discarded, up to `MAX_DRAIN_BYTES`) before the
    413 goes out: a client that writes its whole body before reading (Python's urllib) would
    otherwise see the server close a connection with unread data in it, which is a TCP reset,
    and never read the 413.
    """
    declared = request.headers.get("content-length", "")
    too_large = APIError(f"The request body exceeds the limit of {max_bytes} bytes.", 413,
                         code="request_too_large")
    if declared.isdigit() and int(declared) > MAX_DRAIN_BYTES:
        raise too_large  # too much to read for nothing: the client may see a reset
    body = bytearray()
    seen = 0
    async for chunk in request.stream():  # counted as it arrives: Content-Length may be absent or wrong
        seen += len(chunk)
        if seen > MAX_DRAIN_BYTES:
            raise too_large
        if seen <= max_bytes:
            body += chunk
    if seen > max_bytes or (declared.isdigit() and int(declared) > max_bytes):
        raise too_large
    try:
        return model.model_validate_json(bytes(body))
    except ValidationError as exc:
        raise from_validation_error(exc) from None


# A non-streamed answer still running this long after its first token starts its response (see
# `HeldResponse`), then a space goes out every PROBE_EVERY_S until the body.
FIRST_BYTE_AFTER_S = 0.5
PROBE_EVERY_S = 0.25


async def respond(work: Awaitable[Any],
                  error_shape: Callable[[APIError], JSONResponse] = error_response) -> Response:
    """Await a route's work: dicts become JSON, iterators become SSE, errors `error_shape`
    (OpenAI's; the Messages routes pass Anthropic's). Work still running FIRST_BYTE_AFTER_S after
    its engine call's first item is answered by a `HeldResponse`, so that a client that leaves
    is noticed and its request aborted."""
    first_item = watch_first_item()
    task = asyncio.ensure_future(work)  # a copy of this context: the engine call sets `first_item`
    try:
        if not await _settles(task, first_item):
            return HeldResponse(task, error_shape)
    except BaseException:  # cancelled while waiting: the work goes too
        task.cancel()
        raise
    return _response(task, error_shape)


async def _settles(task: asyncio.Future, first_item: asyncio.Event) -> bool:
    """True once `task` is done; False when it is still running FIRST_BYTE_AFTER_S after its first item."""
    waiter = asyncio.ensure_future(first_item.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not task.done():
        await asyncio.wait({task}, timeout=FIRST_BYTE_AFTER_S)
    return task.done()


def _response(task: asyncio.Future, error_shape: Callable[[APIError], JSONResponse]) -> Response:
    try:
        result = task.result()
    except APIError as exc:
        return error_shape(exc)
    except Exception:
        logger.exception("request failed")
        return error_shape(APIError("Internal server error.", 500, "server_error"))
    if isinstance(result, dict):
        return JSONResponse(result)
    return EventStream(result)


class HeldResponse(Response):
    """A non-streamed answer whose work is past its first token and still running: 200 and its
    headers now, a space (which JSON allows before a value) every PROBE_EVERY_S, then the body.

    Behind HAProxy a request's connection to the replica stays open after its client left,
    until a write to the client fails: HAProxy cannot tell a client's close from a half-close
    (its abortonclose covers queued requests only). The spaces are those writes; HAProxy then
    closes the replica's side, the server's `receive()` says `http.disconnect`, and the work is
    cancelled, which aborts its sequences and frees their blocks. A failure before the first
    item keeps its status (400, 429, 503); one after it (a deadline's 504, a failed engine) is
    the error object as the 200's body."""

    media_type = "application/json"

    def __init__(self, task: asyncio.Future, error_shape: Callable[[APIError], JSONResponse]) -> None:
        self._task, self._error_shape = task, error_shape
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def client_gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        gone = asyncio.ensure_future(client_gone())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            while not self._task.done():
                await asyncio.wait({self._task, gone}, timeout=PROBE_EVERY_S, return_when=asyncio.FIRST_COMPLETED)
                if gone.done():
                    return  # the finally cancels the work
                if not self._task.done():
                    await send({"type": "http.response.body", "body": b" ", "more_body": True})
            await send({"type": "http.response.body", "body": self._body(), "more_body": False})
        finally:
            gone.cancel()
            self._task.cancel()  # a no-op when it is done

    def _body(self) -> bytes:
        response = _response(self._task, self._error_shape)
        if isinstance(response, EventStream):  # never for a non-streamed request
            logger.error("a held response's work returned a stream")
            response = self._error_shape(APIError("Internal server error.", 500, "server_error"))
        if response.status_code != 200:
            logger.warning("request failed after its response started (status %d sent as 200): %s",
                           response.status_code, bytes(response.body)[:300].decode(errors="replace"))
        return bytes(response.body)


def adapter_card(serving: OpenAIServing, name: str, created: int) -> dict[str, Any]:
    """The `/v1/models` card of a LoRA adapter of the served model."""
    info = serving.info
    return {"id": name, "object": "model", "created": created, "owned_by": "qkv-serve",
            "parent": info.served_model_name, "root": info.served_model_name, "max_model_len": info.max_model_len}


def model_cards(serving: OpenAIServing, created: int) -> list[dict[str, Any]]:
    """The `/v1/models` cards of the served model and of its LoRA adapters (those loaded since included)."""
    info = serving.info
    card = {"id": info.served_model_name, "object": "model", "created": created, "owned_by": "qkv-serve",
            "max_model_len": info.max_model_len,
            "kv_cache": {"num_blocks": info.num_kv_blocks, "block_size": info.block_size,
                         "capacity_tokens": info.num_kv_blocks * info.block_size,
                         "max_concurrency": round(max_concurrency(info.num_kv_blocks, info.block_size,
                                                                  info.max_model_len), 2)},
            "tool_call_parser": serving.tool_format.name if serving.tool_format else None,
            "reasoning_parser": "think" if serving.reasoning else None,
            "quantization": info.quantization["method"] if info.quantization else "none",
            "quantization_config": info.quantization}
    return [card, *(adapter_card(serving, name, created) for name in serving.adapter_names())]


def build_api(serving: OpenAIServing, healthy: Callable[[], bool], settings: IngressSettings,
              on_response: Callable[[str, int], None] | None = None,
              app_cards: Callable[[], Awaitable[list[dict[str, Any]]]] | None = None,
              created: int | None = None, batch_metrics: BatchMetrics | None = None,
              batch_offline: Any = None) -> FastAPI:
    """The FastAPI app over `serving`; `healthy()` answers /health (the local engine's state);
    `on_response(route, status)` is called as each response starts (`ResponseCounter`);
    `batch_metrics`: where the batch service (`settings.batch_dir`) reports; `batch_offline`: where
    its large batches run (`settings.batch_offline_min_lines`);
    `app_cards()`: every model's `/v1/models` cards where this replica serves one model of several
    (service/app/multi.py; None: its own model's cards); `created`: the cards' time."""
    app = FastAPI(title="qkv-serve", docs_url=None, redoc_url=None)
    limit = settings.max_body_bytes
    created = int(time.time()) if created is None else created

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(str(exc.detail), exc.status_code, kind))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        async def work() -> Any:
            return await serving.completions(await read_model(request, CompletionRequest, limit))
        return await respond(work())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async def work() -> Any:
            return await serving.chat(await read_model(request, ChatCompletionRequest, limit))
        return await respond(work())

    async def cards() -> list[dict[str, Any]]:
        listed = await app_cards() if app_cards is not None else model_cards(serving, created)
        tenant = current_tenant.get()  # a keys file's tenant sees the models it may use
        return listed if tenant is None else [card for card in listed if tenant.allows(card["id"])]

    @app.get("/v1/models")
    async def models() -> Response:
        async def work() -> Any:
            return {"object": "list", "data": await cards()}
        return await respond(work())

    @app.get("/v1/models/{model_id:path}")
    async def model_by_id(model_id: str) -> Response:
        async def work() -> Any:
            if app_cards is None:
                serving.check_model(model_id)
            for card in await cards():
                if card["id"] == model_id:
                    return card
            if serving.adapter_of(model_id):  # `<served>:<adapter>` not loaded yet: served all the same
                return adapter_card(serving, model_id, created)
            serving.check_model(model_id)  # a 404 naming what is served
            raise APIError(f"The model '{model_id}' does not exist.", 404, "invalid_request_error", "model",
                           "model_not_found")
        return await respond(work())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        async def work() -> Any:
            req = await read_model(request, TokenizeRequest, limit)
            serving.check_model(req.model)
            if req.messages is None:
                tokens = serving.tokenizer.encode(req.prompt, add_special_tokens=True)
            else:  # each image's placeholder expanded to its tokens, as the engine runs the prompt
                tokens = (await serving.chat_prompt(req)).ids
            return {"tokens": tokens, "count": len(tokens), "max_model_len": serving.info.max_model_len}
        return await respond(work())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        async def work() -> Any:
            req = await read_model(request, DetokenizeRequest, limit)
            serving.check_model(req.model)
            ids = serving.token_ids(req.tokens, param="tokens") if req.tokens else []
            return {"prompt": serving.tokenizer.decode(ids)}
        return await respond(work())

    @app.get("/health")
    async def health() -> Response:
        try:
            ok = healthy()
        except Exception as exc:  # a probe that cannot answer: not healthy either way
            logger.warning("health check failed: %s", type(exc).__name__)
            ok = False
        if ok:
            return JSONResponse({"status": "ok"})
        return error_response(APIError("The engine loop is not running.", 503, "server_error"))

    add_attention_routes(app, serving, settings.max_attention_floats, limit, read_model, respond)
    add_embeddings_routes(app, serving, limit, read_model, respond)
    add_messages_routes(app, serving, limit, read_model, respond)
    add_responses_routes(app, serving, limit, read_model, respond)
    if settings.batch_dir is not None:
        add_batch_service(app, serving, settings, batch_metrics, batch_offline)

    lookup = key_lookup(settings)
    if lookup is not None:
        quotas = getattr(serving, "quotas", None)  # None: no keys file (or a stand-in serving in tests)
        add_key_check(app, lookup, quotas.early_refusal if quotas is not None else None)
    app.add_middleware(HeaderLimitMiddleware, max_bytes=settings.max_header_bytes)  # first of the limits
    app.add_middleware(ResponseCounter, record=on_response)  # outermost: sees every answer
    return app
