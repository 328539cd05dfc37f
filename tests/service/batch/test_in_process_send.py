"""`in_process_send` (service/batch/api.py): a batch request into an app's route in the process, as
the batch's tenant and, under priority scheduling, at the lowest priority, with the route's answer
and status; streams refused. The app here is a FastAPI app whose route echoes what it got."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from service.batch.api import LOWEST_PRIORITY, in_process_send
from service.tenancy.auth import current_tenant
from service.tenancy.keys import Limits, Tenant

TENANT = Tenant("acme", frozenset({"*"}), Limits(None, None, None))


def echo_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        tenant = current_tenant.get()
        if body.get("max_tokens", 1) < 1:
            return JSONResponse({"error": {"message": "max_tokens must be at least 1", "param": "max_tokens"}}, 400)
        return JSONResponse({"body": body, "tenant": None if tenant is None else tenant.name})

    return app


def test_a_request_runs_as_its_tenant_at_the_lowest_priority() -> None:
    send = in_process_send(echo_app(), {"acme": TENANT}.get, LOWEST_PRIORITY)
    status, answer = asyncio.run(send("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "acme"))
    assert status == 200 and answer["tenant"] == "acme"
    assert answer["body"] == {"prompt": "hi", "max_tokens": 2, "priority": LOWEST_PRIORITY}
    assert current_tenant.get() is None  # set for the call only


def test_without_priority_scheduling_or_a_tenant_the_body_goes_as_it_is() -> None:
    send = in_process_send(echo_app(), {}.get, None)
    status, answer = asyncio.run(send("/v1/completions", {"prompt": "hi", "priority": 3}, None))
    assert status == 200 and answer == {"body": {"prompt": "hi", "priority": 3}, "tenant": None}


def test_the_routes_error_comes_back_with_its_status_and_streams_are_refused() -> None:
    send = in_process_send(echo_app(), {"acme": TENANT}.get, None)
    status, answer = asyncio.run(send("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "acme"))
    assert status == 400 and answer["error"]["param"] == "max_tokens"
    status, answer = asyncio.run(send("/v1/completions", {"prompt": "hi", "stream": True}, "acme"))
    assert status == 400 and answer["error"]["param"] == "stream"
    status, answer = asyncio.run(send("/v1/completions", {"prompt": "hi"}, "gone"))  # no longer in the keys file
    assert status == 401 and answer["error"]["type"] == "authentication_error"


def test_a_request_waits_while_the_engine_has_a_queue() -> None:
    checks = []

    def busy() -> bool:  # a queue for the first three looks, then none
        checks.append(1)
        return len(checks) <= 3

    send = in_process_send(echo_app(), {}.get, None, busy=busy)
    status, _ = asyncio.run(send("/v1/completions", {"prompt": "hi"}, None))
    assert status == 200 and len(checks) == 4
