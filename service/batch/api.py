"""OpenAI's Files and Batch APIs on a replica's app, over the directory `batch_dir` that the
replicas of a node share, and the loop that runs pending batches in the replica.

Routes: `POST /v1/files` (multipart: `file`, `purpose=batch`), `GET /v1/files`,
`GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`; `POST /v1/batches`,
`GET /v1/batches`, `GET /v1/batches/{id}`, `POST /v1/batches/{id}/cancel`. A tenant (a keys
file's) sees and cancels only its own files and batches.

A batch's request runs through the replica's own app, in the process (`in_process_send`): the
route of the batch's endpoint, with the batch owner's tenant (its quotas count the request) and,
under priority scheduling, the lowest priority, so that it gives the answer or the error the
interactive endpoint gives; it is sent only while no request waits in the engine's queue, and
yields to interactive requests once running (priority scheduling preempts it first).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

from fastapi import FastAPI, Request
from starlette.datastructures import UploadFile
from starlette.responses import JSONResponse, Response

from model.engine.sequence import LOWEST_PRIORITY
from service.batch.batches import BatchJournal
from service.batch.runner import BatchRunner, Send
from service.errors import APIError
from service.tenancy.auth import current_tenant
from service.tenancy.keys import Tenant

logger = logging.getLogger(__name__)

IDLE_POLL_S = 2.0  # how often an idle loop looks for batches another replica's API created
STATUS_REFRESH_S = 5.0  # how often the batches-by-status gauge is set again (Ray drops a gauge left unset)
BUSY_POLL_S = 0.05  # how often a batch request held back looks at the engine's queue again


def _owner() -> str | None:
    tenant = current_tenant.get()
    return None if tenant is None else tenant.name


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _int(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise APIError(f"{name} must be an integer, got {raw!r}.", param=name) from None


class BatchLoop:
    """Runs the pending batches of the directory one after another, in this replica's event loop;
    woken when a batch is created here, else looking again every IDLE_POLL_S (a batch created
    through another replica, or one a stopped process left unfinished). `on_statuses(counts)`:
    given the directory's batches by status every STATUS_REFRESH_S, while a batch runs too."""

    def __init__(self, runner: BatchRunner, on_statuses: Callable[[dict[str, int]], None] | None = None,
                 status_every_s: float = STATUS_REFRESH_S) -> None:
        self.runner, self.on_statuses, self.status_every_s = runner, on_statuses, status_every_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._status_task: asyncio.Task | None = None

    def ensure(self) -> None:
        """Start the loop in the running event loop, once."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())
        if self.on_statuses is not None and (self._status_task is None or self._status_task.done()):
            self._status_task = asyncio.get_running_loop().create_task(self._report_statuses())

    async def _report_statuses(self) -> None:
        while True:
            try:
                counts = await asyncio.to_thread(BatchJournal.status_counts, self.runner.root)
                self.on_statuses(counts)
            except Exception:  # noqa: BLE001 (a metric is not worth stopping for; logged, tried again)
                logger.exception("could not count the batches by status")
            await asyncio.sleep(self.status_every_s)

    def wake(self) -> None:
        self.ensure()
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            for batch_id in await asyncio.to_thread(self.runner.pending):
                try:
                    await self.runner.run(batch_id)  # None: another replica runs it
                except Exception:  # noqa: BLE001 (logged; the batch resumes on a later pass)
                    logger.exception("batch %s stopped; it resumes on a later pass", batch_id)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)
            except asyncio.TimeoutError:
                pass


def in_process_send(app: FastAPI, tenants: Callable[[str], Tenant | None], priority: int | None,
                    busy: Callable[[], bool] | None = None) -> Send:
    """`send` for the runner: the request into `app`'s route for the endpoint, without the HTTP
    edge's key check (the batch's owner is the tenant it runs as), its JSON answer collected.
    `busy()`: whether interactive requests are queueing in the engine; a batch request waits
    until they are not (the batch goes on whenever the engine has room, so it never starves for
    long: interactive queues drain)."""

    async def send(endpoint: str, body: dict[str, Any], owner: str | None) -> tuple[int, dict[str, Any]]:
        while busy is not None and busy():
            await asyncio.sleep(BUSY_POLL_S)
        if body.get("stream"):
            return 400, APIError("stream is not supported in a batch request.", param="stream").body()
        if priority is not None and "priority" not in body:
            body = {**body, "priority": priority}
        tenant = tenants(owner) if owner is not None else None
        if owner is not None and tenant is None:
            return 401, APIError(f"The tenant {owner!r} that created this batch is no longer in the keys file.",
                                 status=401, type="authentication_error").body()
        data = json.dumps(body).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": endpoint, "raw_path": endpoint.encode(), "root_path": "",
                 "query_string": b"", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]}
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await asyncio.Event().wait()  # no disconnect: the answer is awaited to its end
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}

        status, chunks = 500, []

        async def reply(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        token = current_tenant.set(tenant)
        try:
            async with AsyncExitStack() as stack:  # what FastAPI's own middleware stack hands its routes
                scope["fastapi_middleware_astack"] = stack
                await app.router(scope, receive, reply)  # below the middleware: no key check, the route's own limits
        finally:
            current_tenant.reset(token)
        raw = b"".join(chunks)
        try:
            answer = json.loads(raw)
        except ValueError:
            return 500, APIError(f"The endpoint's answer was not JSON: {raw[:200]!r}", status=500,
                                 type="server_error").body()
        if status == 200 and isinstance(answer, dict) and "error" in answer and len(answer) == 1:
            status = 500  # an error after the response had started (a held answer's late failure)
        return status, answer

    return send


def add_batch_routes(app: FastAPI, runner: BatchRunner, loop: BatchLoop) -> None:
    """The Files and Batch APIs' routes on `app`."""
    files = runner.files

    async def answer(work: Callable[[], Any]) -> Response:
        """`work`'s JSON, run off the event loop (the store may answer over the network; the
        caller's tenant goes with it, as asyncio.to_thread copies the context)."""
        loop.ensure()
        try:
            return JSONResponse(await asyncio.to_thread(work))
        except APIError as exc:
            return _error(exc)

    @app.post("/v1/files")
    async def upload(request: Request) -> Response:
        try:
            form = await request.form(max_part_size=files.max_bytes + 1)
        except Exception as exc:  # noqa: BLE001 (any malformed multipart body is the client's)
            return _error(APIError(f"The body must be multipart/form-data with `file` and `purpose`: {exc}",
                                   param="file"))
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            return _error(APIError("A file is required (the multipart field `file`).", param="file"))
        content = await upload.read()
        return await answer(lambda: files.create(content, upload.filename or "upload.jsonl", str(purpose),
                                                 _owner()).to_openai())

    @app.get("/v1/files")
    async def list_files(request: Request) -> Response:
        q = request.query_params
        return await answer(lambda: files.list(_owner(), q.get("purpose"), q.get("after"),
                                               _int(request, "limit", 10_000), q.get("order", "desc")))

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str) -> Response:
        return await answer(lambda: files.get(file_id, _owner()).to_openai())

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        owner = _owner()
        try:
            return Response(await asyncio.to_thread(files.content, file_id, owner),
                            media_type="application/octet-stream")
        except APIError as exc:
            return _error(exc)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> Response:
        return await answer(lambda: files.delete(file_id, _owner()))

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(APIError("The body must be a JSON object."))
        if not isinstance(body, dict) or not isinstance(body.get("input_file_id"), str):
            return _error(APIError("input_file_id is required.", param="input_file_id"))
        response = await answer(lambda: runner.create(body["input_file_id"], str(body.get("endpoint")),
                                                      str(body.get("completion_window")), body.get("metadata"),
                                                      _owner()).to_openai())
        if response.status_code == 200:
            loop.wake()
        return response

    @app.get("/v1/batches")
    async def list_batches(request: Request) -> Response:
        return await answer(lambda: runner.list(_owner(), request.query_params.get("after"),
                                                _int(request, "limit", 20)))

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str) -> Response:
        return await answer(lambda: runner.get(batch_id, _owner()).to_openai())

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> Response:
        return await answer(lambda: runner.cancel(batch_id, _owner()).to_openai())
