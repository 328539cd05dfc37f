"""The quota ledger: every tenant's requests, tokens and requests in flight over the last minute,
counted for all replicas in one place.

A replica asks `acquire` before a request runs and gets a lease, or the limit it would break and
when to come back. It reports the tokens its tenants generate and the leases it gave back (and
still holds) every fraction of a second (`report`). A replica that stops reporting (it died) has
its leases dropped after `lease_ttl_s`, so a dead replica's requests do not hold a tenant's
concurrency forever. The ledger itself is one small Serve deployment (`QuotaLedgerDeployment`);
if it restarts, the counts start again from zero.

Asking costs a request a few milliseconds, so a replica need not ask for a tenant far from its
limits: each report's answer (`View`) grants the replica an allowance of that tenant's requests,
prompt tokens and concurrency that it may admit on its own until its next report, and the ledger
counts every replica's outstanding allowance as used when another one asks. The replicas then
never pass a limit together, and near a limit (or under a small one) every request asks.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ray import serve

from service.tenancy.keys import Limits

WINDOW_S = 60.0  # requests and tokens per minute: a sliding minute


@dataclass(frozen=True)
class Grant:
    """`acquire`'s answer: a lease, or the limit that refused it and when to retry."""

    lease: str | None
    limit: str | None = None  # "requests_per_minute" | "tokens_per_minute" | "max_concurrency"
    retry_after_s: float = 0.0


# An allowance lapses this long after it was given (a replica stops using its View sooner:
# service/tenancy/quotas.py VIEW_TTL_S), so an idle replica holds no reservation.
ALLOWANCE_TTL_S = 1.0
# A dimension with no limit: an allowance that never runs out.
UNLIMITED = 1 << 62


@dataclass(frozen=True)
class View:
    """What a replica may admit on its own until its next report: per tenant, (requests, prompt
    tokens, requests in flight). A tenant gets an allowance while it uses at most half of each of
    its limits, counting every replica's allowance; each replica gets 1 / (2 x replicas) of each."""

    allowances: dict[str, tuple[int, int, int]]


@dataclass
class _Usage:
    requests: deque[float] = field(default_factory=deque)  # admission times in the window
    tokens: deque[list[float]] = field(default_factory=deque)  # [whole second, tokens] in the window
    token_sum: int = 0
    leases: set[str] = field(default_factory=set)


class QuotaLedger:
    """The counts themselves (no Ray): one instance for the app, behind `QuotaLedgerDeployment`."""

    def __init__(self, lease_ttl_s: float = 15.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._usage: dict[str, _Usage] = {}
        self._leases: dict[str, tuple[str, str]] = {}  # lease -> (tenant, holder)
        self._seen: dict[str, float] = {}  # holder -> when it last called
        self._ids = itertools.count()
        # holder -> its View's allowances and when they were given (they lapse after ALLOWANCE_TTL_S)
        self._allowed: dict[str, tuple[dict[str, tuple[int, int, int]], float]] = {}

    def acquire(self, tenant: str, limits: Limits, prompt_tokens: int, holder: str,
                released: list[str] = ()) -> Grant:
        """Admit one request of `tenant` (its prompt counts towards its tokens now), or refuse it;
        `released`: the asker's leases given back since its last report, dropped first (a client
        that sends its next request as the last one ends is not refused for the one just done)."""
        now = self._clock()
        self._seen[holder] = now
        for lease in released:
            self._drop(lease)
        self._expire(now)
        u = self._usage.setdefault(tenant, _Usage())
        self._prune(u, now)
        requests, tokens, in_flight = self._used(tenant, u)
        if limits.max_concurrency is not None and in_flight >= limits.max_concurrency:
            return Grant(None, "max_concurrency", 1.0)
        if limits.requests_per_minute is not None and requests >= limits.requests_per_minute:
            return Grant(None, "requests_per_minute", u.requests[0] + WINDOW_S - now if u.requests else 1.0)
        if limits.tokens_per_minute is not None and tokens >= limits.tokens_per_minute:
            return Grant(None, "tokens_per_minute", self._tokens_free_in(u, limits.tokens_per_minute, now))
        lease = f"{holder}/{next(self._ids)}"
        self._register(lease, tenant, holder, prompt_tokens, now)
        return Grant(lease)

    def report(self, holder: str, tokens: dict[str, int], released: list[str],
               admitted: list[tuple[str, str, int]] = (), limits: dict[str, Limits] | None = None) -> View:
        """From a replica: tokens generated per tenant since its last report, the leases it gave
        back, the requests it admitted on its own (lease, tenant, prompt tokens), and the limits
        of the tenants it serves; the call itself says that the leases it still holds are in use.
        Returns its allowances until its next report (`View`)."""
        now = self._clock()
        self._seen[holder] = now
        self._allowed.pop(holder, None)  # spent: what it admitted with it is in `admitted`
        for lease, tenant, prompt_tokens in admitted:
            self._register(lease, tenant, holder, prompt_tokens, now)
        for tenant, n in tokens.items():
            u = self._usage.setdefault(tenant, _Usage())
            self._prune(u, now)
            self._add_tokens(u, n, now)
        for lease in released:
            self._drop(lease)
        self._expire(now)
        allowed = {}
        share = 2 * len(self._seen)
        for tenant, lim in (limits or {}).items():
            u = self._usage.setdefault(tenant, _Usage())
            self._prune(u, now)
            used = self._used(tenant, u)
            caps = (lim.requests_per_minute, lim.tokens_per_minute, lim.max_concurrency)
            if all(cap is None or 2 * n <= cap for n, cap in zip(used, caps)):
                allowance = tuple(UNLIMITED if cap is None else cap // share for cap in caps)
                if all(a >= 1 for a in allowance):
                    allowed[tenant] = allowance
        self._allowed[holder] = (allowed, now)
        return View(allowed)

    def usage(self, tenant: str) -> dict[str, int]:
        """What `tenant` uses now: requests and tokens in the last minute, requests in flight."""
        u = self._usage.get(tenant, _Usage())
        self._prune(u, self._clock())
        return {"requests": len(u.requests), "tokens": u.token_sum, "in_flight": len(u.leases)}

    def _used(self, tenant: str, u: _Usage) -> tuple[int, int, int]:
        """`tenant`'s requests, tokens and requests in flight, with what the replicas may still
        admit on their own (their allowances, the asker's own included) counted as used."""
        used = [len(u.requests), u.token_sum, len(u.leases)]
        now = self._clock()
        for allowed, given in self._allowed.values():
            if tenant in allowed and now - given <= ALLOWANCE_TTL_S:
                used = [n + (a if a != UNLIMITED else 0) for n, a in zip(used, allowed[tenant])]
        return used[0], used[1], used[2]

    def _register(self, lease: str, tenant: str, holder: str, prompt_tokens: int, now: float) -> None:
        """An admitted request: its lease in flight, one request and its prompt's tokens in the minute."""
        u = self._usage.setdefault(tenant, _Usage())
        self._leases[lease] = (tenant, holder)
        u.leases.add(lease)
        u.requests.append(now)
        self._add_tokens(u, prompt_tokens, now)

    def _drop(self, lease: str) -> None:
        owner = self._leases.pop(lease, None)
        if owner is not None:
            self._usage[owner[0]].leases.discard(lease)

    def _expire(self, now: float) -> None:
        dead = {h for h, t in self._seen.items() if now - t > self.lease_ttl_s}
        if not dead:
            return
        for lease in [lease for lease, (_, h) in self._leases.items() if h in dead]:
            self._drop(lease)
        for h in dead:
            del self._seen[h]
            self._allowed.pop(h, None)

    @staticmethod
    def _prune(u: _Usage, now: float) -> None:
        while u.requests and u.requests[0] <= now - WINDOW_S:
            u.requests.popleft()
        while u.tokens and u.tokens[0][0] + 1 <= now - WINDOW_S:
            u.token_sum -= int(u.tokens.popleft()[1])

    @staticmethod
    def _add_tokens(u: _Usage, n: int, now: float) -> None:
        if n <= 0:
            return
        second = math.floor(now)
        if u.tokens and u.tokens[-1][0] == second:
            u.tokens[-1][1] += n
        else:
            u.tokens.append([second, n])
        u.token_sum += n

    @staticmethod
    def _tokens_free_in(u: _Usage, limit: int, now: float) -> float:
        """Seconds until the tokens in the window drop below `limit`."""
        left = u.token_sum
        for second, n in u.tokens:
            left -= int(n)
            if left < limit:
                return max(second + 1 + WINDOW_S - now, 0.0)
        return WINDOW_S


@serve.deployment(name="Quotas", num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
class QuotaLedgerDeployment:
    """The app's one ledger (a single replica: the counts live in it)."""

    def __init__(self, lease_ttl_s: float = 15.0) -> None:
        self._ledger = QuotaLedger(lease_ttl_s)

    async def acquire(self, tenant: str, limits: Limits, prompt_tokens: int, holder: str,
                      released: list[str] = ()) -> Grant:
        return self._ledger.acquire(tenant, limits, prompt_tokens, holder, released)

    async def report(self, holder: str, tokens: dict[str, int], released: list[str],
                     admitted: list[tuple[str, str, int]] = (), limits: dict[str, Limits] | None = None) -> View:
        return self._ledger.report(holder, tokens, released, admitted, limits)

    async def usage(self, tenant: str) -> dict[str, int]:
        return self._ledger.usage(tenant)
