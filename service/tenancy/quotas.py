"""A replica's side of the quota ledger: admit a tenant's request (or answer 429), count its
tokens as they are generated, give its lease back; tokens and releases go to the ledger in one
report every `report_interval_s`, not one call each.

A call to the ledger costs a few milliseconds of the request's time to first token, so a tenant
far from its limits is admitted without one: each report brings back this replica's allowance
(the ledger's `View`), within which it admits on its own and tells the ledger with its next
report. Near a limit (and under small limits) every request asks.

If the ledger cannot be reached in `timeout_s`, the request is let through (and logged, and
counted in `errors`): an outage of the counter does not become an outage of the service.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
import uuid
from typing import Any

from service.errors import APIError, retry_after_headers, retry_after_seconds
from service.tenancy.keys import Tenant
from service.tenancy.ledger import Grant, QuotaLedger, View

logger = logging.getLogger(__name__)

VIEW_TTL_S = 0.75  # a View older than this admits nothing here (the ledger keeps it reserved for 1 s)
# A tenant the ledger refused is refused here, without asking, for this long (or until one of its
# requests here finishes, for its concurrency): a flood's excess costs no ledger call each.
REFUSAL_TTL_S = 0.25
LIMIT_NAMES = {"requests_per_minute": "requests per minute", "tokens_per_minute": "tokens per minute",
               "max_concurrency": "requests in flight"}


def rate_limited(tenant: Tenant, grant: Grant) -> APIError:
    """429 in the API's error shape, with `Retry-After` in whole seconds (and a jittered
    `retry-after-ms`)."""
    seconds = retry_after_seconds(grant.retry_after_s)
    limit = getattr(tenant.limits, grant.limit or "", None)
    return APIError(f"Rate limit reached for '{tenant.name}' on {LIMIT_NAMES.get(grant.limit or '', grant.limit)} "
                    f"(limit {limit}). Retry after {seconds} s.", 429, "rate_limit_error",
                    code="rate_limit_exceeded", headers=retry_after_headers(grant.retry_after_s))


class Quotas:
    """`ledger`: a handle to `QuotaLedgerDeployment` (calls are awaited `.remote()`s), or None for
    a ledger of this process alone (one replica, tests). `metrics`: the replica's `EngineMetrics`
    (per-tenant counters), or None."""

    def __init__(self, ledger: Any = None, metrics: Any = None, report_interval_s: float = 0.25,
                 timeout_s: float = 2.0) -> None:
        self._remote = ledger is not None
        self._ledger = ledger if ledger is not None else QuotaLedger()
        self._metrics = metrics
        self.holder = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self.report_interval_s = report_interval_s
        self.timeout_s = timeout_s
        self.errors = 0  # ledger calls that failed or timed out (requests let through)
        self._tokens: dict[str, int] = {}  # generated since the last report, by tenant
        self._requests: dict[str, tuple[int, int]] = {}  # (requests, prompt tokens) since the last report
        self._released: list[str] = []
        self._held = 0  # leases in flight: while any, the reports go on (the ledger's heartbeat)
        self._reporter: asyncio.Task | None = None
        self._view: View | None = None  # the ledger's, from the last report
        self._view_at = 0.0
        self._admitted: list[tuple[str, str, int]] = []  # admitted here since the last report was sent
        self._reporting: list[tuple[str, str, int]] = []  # what the report in flight carries of `_admitted`
        self._lease_ids = itertools.count()
        self.admitted_locally = 0  # requests admitted without asking the ledger
        self._limits: dict[str, Any] = {}  # the limits of the tenants seen here, sent with each report
        self._refused: dict[str, tuple[Grant, float]] = {}  # tenant -> the ledger's last refusal, when
        self.refused_locally = 0
        self._asking: dict[str, asyncio.Future] = {}  # tenant -> done when its ledger call in flight answers

    async def admit(self, tenant: Tenant, prompt_tokens: int) -> str | None:
        """A lease for one request of `tenant` (None: no limit to hold it against); raises the
        429 when a limit refuses it."""
        self._count_request(tenant.name, prompt_tokens)
        if tenant.limits.unlimited:
            return None
        self._limits[tenant.name] = tenant.limits
        lease = self._admit_locally(tenant, prompt_tokens) if self._remote else None
        if lease is None:
            grant = self._refused_lately(tenant.name)
            asking = self._asking.get(tenant.name)
            if grant is None and asking is not None:
                # The tenant's request ahead is asking the ledger: its refusal answers this one too
                # (a burst of a refused tenant's retries costs one ledger call, not one each).
                await asyncio.wait([asking])
                grant = self._refused_lately(tenant.name)
            if grant is None:
                grant = await self._ask(tenant, prompt_tokens)
            if grant.limit is not None:
                if self._metrics is not None:
                    self._metrics.observe_tenant_rejection(tenant.name, grant.limit)
                raise rate_limited(tenant, grant)
            lease = grant.lease
        if lease is not None:
            self._held += 1
            self._ensure_reporter()
        return lease

    def _count_request(self, name: str, prompt_tokens: int) -> None:
        """One request of `name`, for the per-tenant metrics of the next report."""
        seen = self._requests.get(name, (0, 0))
        self._requests[name] = (seen[0] + 1, seen[1] + prompt_tokens)
        self._ensure_reporter()

    def early_refusal(self, tenant: Tenant) -> APIError | None:
        """The 429 for a tenant refused in the last moment, before its request is even read (the
        HTTP edge asks first: a flood's excess then costs little more than its headers); None:
        read it and `admit` it as usual."""
        grant = self._refused_lately(tenant.name) if not tenant.limits.unlimited else None
        if grant is None:
            return None
        self._count_request(tenant.name, 0)  # its prompt is never read
        if self._metrics is not None:
            self._metrics.observe_tenant_rejection(tenant.name, grant.limit)
        return rate_limited(tenant, grant)

    def _refused_lately(self, name: str) -> Grant | None:
        """The ledger's refusal of `name` in the last REFUSAL_TTL_S, its Retry-After counted down."""
        refused = self._refused.get(name)
        if refused is None:
            return None
        grant, at = refused
        elapsed = time.monotonic() - at
        if elapsed > min(REFUSAL_TTL_S, grant.retry_after_s):
            del self._refused[name]
            return None
        self.refused_locally += 1
        return Grant(None, grant.limit, grant.retry_after_s - elapsed)

    def _admit_locally(self, tenant: Tenant, prompt_tokens: int) -> str | None:
        """A lease made here (reported with the next report) within this replica's allowance, else None."""
        view = self._view
        allowance = view.allowances.get(tenant.name) if view is not None else None
        if allowance is None or time.monotonic() - self._view_at > VIEW_TTL_S:
            return None
        mine = [0, 0, 0]  # requests, prompt tokens and requests in flight admitted here since the View
        for _, name, tokens in (*self._reporting, *self._admitted):
            if name == tenant.name:
                mine = [mine[0] + 1, mine[1] + tokens, mine[2] + 1]
        if mine[0] + 1 > allowance[0] or mine[1] + prompt_tokens > allowance[1] or mine[2] + 1 > allowance[2]:
            return None
        lease = f"{self.holder}/r{next(self._lease_ids)}"  # the ledger numbers its own leases without the r
        self._admitted.append((lease, tenant.name, prompt_tokens))
        self.admitted_locally += 1
        return lease

    async def _ask(self, tenant: Tenant, prompt_tokens: int) -> Grant:
        """The ledger's grant, a refusal kept for REFUSAL_TTL_S; while it is asked, the tenant's
        later requests wait for its answer (`_asking`)."""
        asking = self._asking.get(tenant.name)
        mine = asking is None
        if mine:
            asking = self._asking[tenant.name] = asyncio.get_running_loop().create_future()
        try:
            grant = await self._acquire(tenant, prompt_tokens)
            if grant.limit is not None:
                self._refused[tenant.name] = (grant, time.monotonic())
            return grant
        finally:
            if mine:
                del self._asking[tenant.name]
                asking.set_result(None)

    async def _acquire(self, tenant: Tenant, prompt_tokens: int) -> Grant:
        if not self._remote:
            return self._ledger.acquire(tenant.name, tenant.limits, prompt_tokens, self.holder)
        # Given back first, not at the next report; a lease admitted here and not yet reported
        # waits for that report, which registers it before it is dropped.
        pending = {lease for lease, _, _ in (*self._admitted, *self._reporting)}
        released = [lease for lease in self._released if lease not in pending]
        self._released = [lease for lease in self._released if lease in pending]
        call = self._ledger.acquire.remote(tenant.name, tenant.limits, prompt_tokens, self.holder, released)
        try:
            return await asyncio.wait_for(_awaited(call), self.timeout_s)
        except Exception as exc:  # the ledger down or slow: let the request through
            self._released = released + self._released  # a lost release would hold its slot for good
            self.errors += 1
            logger.warning("quota ledger unavailable (%s): admitting %s's request unchecked",
                           type(exc).__name__, tenant.name)
            return Grant(None)

    def add_tokens(self, tenant: Tenant, n: int) -> None:
        """`n` tokens generated for `tenant`: counted now, reported with the next report."""
        if n > 0:
            self._tokens[tenant.name] = self._tokens.get(tenant.name, 0) + n
            self._ensure_reporter()

    def finished(self, tenant: Tenant, out: Any) -> None:
        """One of `tenant`'s requests finished (a `RequestOutput`): its time to first token."""
        times = out.times
        if self._metrics is not None and times is not None and times.first_token is not None:
            self._metrics.observe_tenant_ttft(tenant.name, max(times.first_token - times.arrival, 0.0))

    def release(self, lease: str | None, tenant: Tenant | None = None) -> None:
        """Give back a lease of `tenant`'s (from `admit`) once its request is over."""
        if lease is None:
            return
        refused = self._refused.get(tenant.name) if tenant is not None else None
        if refused is not None and refused[0].limit == "max_concurrency":
            del self._refused[tenant.name]  # a slot of its own is free now: ask again
        self._held -= 1
        self._released.append(lease)
        if not self._remote:
            self._report()

    def _ensure_reporter(self) -> None:
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    async def _report_loop(self) -> None:
        while self._tokens or self._requests or self._released or self._admitted or self._held > 0:
            await asyncio.sleep(self.report_interval_s)
            await self.report()

    async def report(self) -> None:
        """Send what was counted since the last report (also the heartbeat of the leases held)."""
        if not self._remote:
            self._report()
            return
        tokens, released = self._report_local_counts()
        admitted, self._admitted = self._admitted, []
        self._reporting = admitted  # an acquire meanwhile must not release these; they still count as mine
        try:
            view = await asyncio.wait_for(
                _awaited(self._ledger.report.remote(self.holder, tokens, released, admitted, dict(self._limits))),
                self.timeout_s)
        except Exception as exc:  # its tokens are lost (never counted twice); its leases go with the next one
            self._released = released + self._released
            self._admitted = admitted + self._admitted
            self.errors += 1
            logger.warning("quota ledger report failed: %s", type(exc).__name__)
            return
        finally:
            self._reporting = []
        # The View counts what this report carried; what was admitted here meanwhile is in _admitted.
        self._view, self._view_at = view, time.monotonic()

    def _report(self) -> None:
        """The report to this process's own ledger (no call to wait for)."""
        tokens, released = self._report_local_counts()
        self._ledger.report(self.holder, tokens, released)

    def _report_local_counts(self) -> tuple[dict[str, int], list[str]]:
        tokens, self._tokens = self._tokens, {}
        released, self._released = self._released, []
        requests, self._requests = self._requests, {}
        if self._metrics is not None:  # one call per tenant and report, not per request or token
            for name, (n, prompt_tokens) in requests.items():
                self._metrics.observe_tenant_request(name, n, prompt_tokens)
            for name, n in tokens.items():
                self._metrics.observe_tenant_tokens(name, n)
        return tokens, released


async def _awaited(call: Any) -> Any:
    return await call
