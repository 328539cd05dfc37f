"""The HTTP edge's key check: 401 for a missing or wrong key (Anthropic's shape on the Messages
routes). With one key (`api_key`) that is all; with a keys file (`api_keys_file`) the request runs
with its tenant in `current_tenant`, where the model check (403), the quotas (429) and the
default priority find it."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from contextvars import ContextVar

from starlette.types import ASGIApp, Receive, Scope, Send

from service.errors import APIError
from service.tenancy.keys import KeyTable, Tenant

current_tenant: ContextVar[Tenant | None] = ContextVar("qkv_tenant", default=None)


def presented_keys(headers: dict[bytes, bytes], messages: bool) -> list[bytes]:
    """The keys a request sends: `Authorization: Bearer <key>`, and `x-api-key` on the Messages
    routes (either may carry it: Anthropic's SDK sends one or the other)."""
    keys = []
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        keys.append(token.strip())
    if messages and headers.get(b"x-api-key", b"").strip():
        keys.append(headers[b"x-api-key"].strip())
    return keys


Lookup = Callable[[bytes], tuple[bool, Tenant | None]]


def single_key(api_key: str) -> Lookup:
    """The one-key mode: the key is compared in constant time; requests run with no tenant."""
    expected = api_key.encode()
    return lambda key: (hmac.compare_digest(key, expected), None)


def keys_file(table: KeyTable) -> Lookup:
    """The keys-file mode: the key's tenant, if it has one."""
    def lookup(key: bytes) -> tuple[bool, Tenant | None]:
        tenant = table.lookup(key)
        return tenant is not None, tenant
    return lookup


class KeyMiddleware:
    """401 unless the request's key passes `lookup`; `open_paths` need none, the Messages routes
    (`messages_path`) also take `x-api-key` and answer in Anthropic's shape (`error_shapes`: the
    OpenAI and the Anthropic error response builders)."""

    def __init__(self, app: ASGIApp, lookup: Lookup, open_paths: frozenset[str], messages_path: str,
                 error_shapes: tuple[Callable[[APIError], ASGIApp], Callable[[APIError], ASGIApp]],
                 precheck: Callable[[Tenant], APIError | None] | None = None) -> None:
        """`precheck(tenant)`: an answer for the tenant's request before it is read (the quotas' 429
        for a tenant refused a moment ago), or None to go on."""
        self.app = app
        self._lookup = lookup
        self._precheck = precheck
        self._open = open_paths
        self._messages = messages_path
        self._openai_error, self._anthropic_error = error_shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        messages = path == self._messages or path.startswith(self._messages + "/")
        ok, tenant = False, None
        for key in presented_keys(dict(scope["headers"]), messages):
            ok, tenant = self._lookup(key)
            if ok:
                break
        if not ok:
            err = APIError("Invalid or missing API key: send 'Authorization: Bearer <key>'"
                           + (" or 'x-api-key: <key>'." if messages else "."), 401, "authentication_error",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await (self._anthropic_error if messages else self._openai_error)(err)(scope, receive, send)
            return
        if tenant is None:
            await self.app(scope, receive, send)
            return
        refusal = self._precheck(tenant) if self._precheck is not None else None
        if refusal is not None:
            await (self._anthropic_error if messages else self._openai_error)(refusal)(scope, receive, send)
            return
        token = current_tenant.set(tenant)
        try:
            await self.app(scope, receive, send)
        finally:
            current_tenant.reset(token)
