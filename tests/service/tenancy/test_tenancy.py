"""Tenants: the keys file (hashed keys, validation, reload without a restart), the quota ledger's
counts (requests and tokens per minute, concurrency, leases of a replica that died), and the HTTP
edge answering 401 / 403 / 429 with the official clients over a real engine in this process."""

from __future__ import annotations

import asyncio
import inspect
import os
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from service.server.api import IngressSettings
from service.tenancy.keys import KeyTable, Limits, hash_key, parse_keys
from service.tenancy.ledger import ALLOWANCE_TTL_S, UNLIMITED, WINDOW_S, QuotaLedger
from service.tenancy.quotas import Quotas
from tests.support.in_process import edge_app
from tests.support.tiny_models import write_tiny_llama

MODEL = "tiny"


def keys_yaml(**tenants: dict[str, Any]) -> str:
    """A keys file whose tenants each have one key, `key-<tenant>`, and the given fields."""
    lines = ["tenants:"]
    for name, fields in tenants.items():
        lines.append(f"  {name}:")
        lines.append(f"    keys: [\"{hash_key('key-' + name)}\"]")
        lines.extend(f"    {k}: {v!r}" if not isinstance(v, list) else f"    {k}: {v}" for k, v in fields.items())
    return "\n".join(lines) + "\n"


# ---- the keys file ----------------------------------------------------------------------------

def test_a_keys_file_names_tenants_by_the_hash_of_their_keys() -> None:
    table = parse_keys(keys_yaml(a={"requests_per_minute": 5, "priority": -1}, b={"models": ["tiny"]}))
    a = table[hash_key("key-a")]
    assert (a.name, a.limits, a.priority) == ("a", Limits(5, None, None), -1)
    assert a.allows("anything") and table[hash_key("key-b")].allows("tiny")
    assert not table[hash_key("key-b")].allows("other")
    assert hash_key("key-a").startswith("sha256:") and len(hash_key("key-a")) == 7 + 64


@pytest.mark.parametrize("text, says", [
    ("tenants: {a: {keys: [\"plain-key\"]}}", "keys.0"),
    (keys_yaml(a={"requests_per_minute": 0}), "requests_per_minute"),
    (keys_yaml(a={"rate": 1}), "rate"),
    ("tenants: {}", "tenants"),
    ("tenants: {\"bad name!\": {keys: [\"%s\"]}}" % hash_key("x"), "bad name!"),
    ("tenants: {a: {keys: [\"%s\"]}, b: {keys: [\"%s\"]}}" % (hash_key("x"), hash_key("x")), "both 'a' and 'b'"),
    ("tenants: [", "not YAML"),
])
def test_a_bad_keys_file_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_keys(text)
    assert says in str(err.value)


def test_the_keys_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(a={}))
    table = KeyTable(path, reload_interval_s=0.0)
    assert table.lookup("key-a").name == "a" and table.lookup("key-b") is None
    path.write_text(keys_yaml(b={"max_concurrency": 2}))
    os.utime(path, ns=(1, 1))  # a different mtime even on a coarse clock
    assert table.lookup("key-a") is None and table.lookup("key-b").limits.max_concurrency == 2
    path.write_text("tenants: [")  # broken: the last good table stays
    os.utime(path, ns=(2, 2))
    assert table.lookup("key-b").name == "b"
    assert (table.reloads, table.reload_errors) == (1, 1)


def test_a_service_does_not_start_without_its_keys(tmp_path: Path) -> None:
    from service.app import AppArgs

    with pytest.raises(ValueError, match="cannot read the keys file"):
        AppArgs(model="transformer-base", api_keys_file=str(tmp_path / "missing.yaml"))
    (tmp_path / "k.yaml").write_text(keys_yaml(a={}))
    with pytest.raises(ValueError, match="not both"):
        AppArgs(model="transformer-base", api_keys_file=str(tmp_path / "k.yaml"), api_key="x")


# ---- the ledger ---------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_requests_per_minute_is_a_sliding_minute() -> None:
    clock = Clock()
    ledger = QuotaLedger(clock=clock)
    limits = Limits(requests_per_minute=2)
    assert ledger.acquire("a", limits, 10, "r1").lease is not None
    clock.t += 20
    assert ledger.acquire("a", limits, 10, "r1").lease is not None
    refused = ledger.acquire("a", limits, 10, "r1")
    assert refused.lease is None and refused.limit == "requests_per_minute"
    assert refused.retry_after_s == pytest.approx(WINDOW_S - 20)  # when the first leaves the window
    assert ledger.acquire("b", limits, 10, "r1").lease is not None  # another tenant has its own minute
    clock.t += WINDOW_S - 20
    assert ledger.acquire("a", limits, 10, "r1").lease is not None


def test_tokens_per_minute_counts_prompts_and_generated_tokens() -> None:
    clock = Clock()
    ledger = QuotaLedger(clock=clock)
    limits = Limits(tokens_per_minute=100)
    lease = ledger.acquire("a", limits, 40, "r1").lease
    ledger.report("r1", {"a": 30}, [lease])
    assert ledger.usage("a") == {"requests": 1, "tokens": 70, "in_flight": 0}
    assert ledger.acquire("a", limits, 40, "r1").lease is not None  # 70 < 100: admitted, now 110
    refused = ledger.acquire("a", limits, 1, "r1")
    assert refused.limit == "tokens_per_minute" and 0 < refused.retry_after_s <= WINDOW_S + 1
    clock.t += refused.retry_after_s
    assert ledger.acquire("a", limits, 1, "r1").lease is not None


def test_concurrency_is_held_by_leases_and_freed_when_a_replica_stops_reporting() -> None:
    clock = Clock()
    ledger = QuotaLedger(lease_ttl_s=10, clock=clock)
    limits = Limits(max_concurrency=2)
    dead = ledger.acquire("a", limits, 1, "replica-dead").lease
    alive = ledger.acquire("a", limits, 1, "replica-alive").lease
    assert dead and alive
    assert ledger.acquire("a", limits, 1, "replica-alive").limit == "max_concurrency"
    for _ in range(3):  # the live replica keeps reporting; the dead one is silent
        clock.t += 4
        ledger.report("replica-alive", {}, [])
    assert ledger.usage("a")["in_flight"] == 1  # the dead replica's lease was dropped, the live one's kept
    assert ledger.acquire("a", limits, 1, "replica-alive").lease is not None


# ---- the HTTP edge --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from model.config import EngineConfig
    from model.engine.builder import build_engine

    directory = write_tiny_llama(tmp_path_factory.mktemp("tenancy") / "tiny", vocab_size=300)
    return build_engine(str(directory), EngineConfig(num_kv_blocks=64, max_num_seqs=4), device="cpu", dtype="float32")


class TenantCounts:
    """Stands in for the per-tenant part of `EngineMetrics`."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.rejections: list[tuple[str, str]] = []
        self.generated: dict[str, int] = {}
        self.ttfts: list[str] = []

    def observe_tenant_request(self, tenant: str, requests: int, prompt_tokens: int) -> None:
        self.requests[tenant] = self.requests.get(tenant, 0) + requests

    def observe_tenant_rejection(self, tenant: str, limit: str) -> None:
        self.rejections.append((tenant, limit))

    def observe_tenant_tokens(self, tenant: str, n: int) -> None:
        self.generated[tenant] = self.generated.get(tenant, 0) + n

    def observe_tenant_ttft(self, tenant: str, seconds: float) -> None:
        assert seconds >= 0
        self.ttfts.append(tenant)


def test_the_edge_answers_as_the_keys_file_says(engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    monkeypatch.setattr("service.tenancy.quotas.REFUSAL_TTL_S", 30.0)  # no timing in the test
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(limited={"requests_per_minute": 2}, other={"models": ["someone-else"]},
                              free={}))
    counts = TenantCounts()
    quotas = Quotas(None, counts)

    async def run() -> None:
        async with edge_app(engine, MODEL, IngressSettings(api_keys_file=str(path)), quotas=quotas) as app, \
                httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://edge", timeout=60) as http:
            def client(key: str) -> openai.AsyncOpenAI:
                return openai.AsyncOpenAI(base_url="http://edge/v1", api_key=key, http_client=http, max_retries=0)

            with pytest.raises(openai.AuthenticationError) as err:
                await client("wrong").completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert err.value.body["code"] == "invalid_api_key"
            with pytest.raises(openai.PermissionDeniedError) as err:
                await client("key-other").completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert err.value.body["code"] == "model_not_allowed" and err.value.body["param"] == "model"
            assert [m.id async for m in client("key-other").models.list()] == []  # it sees what it may use
            assert [m.id async for m in client("key-free").models.list()] == [MODEL]

            limited = client("key-limited")
            outs = [await limited.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                                     extra_body={"ignore_eos": True}) for _ in range(2)]
            with pytest.raises(openai.RateLimitError) as err:
                await limited.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                      max_tokens=2)
            assert err.value.body["code"] == "rate_limit_exceeded" and err.value.body["type"] == "rate_limit_error"
            headers = err.value.response.headers
            assert 1 <= int(headers["Retry-After"]) <= 60
            # What the official SDKs wait for first: the same wait to the millisecond, plus jitter.
            assert int(headers["Retry-After"]) - 1 < int(headers["retry-after-ms"]) / 1e3 <= int(headers["Retry-After"]) + 1
            assert counts.rejections == [("limited", "requests_per_minute")]
            # Refused a moment ago: the next one is refused before its body is read, no ledger asked.
            with pytest.raises(openai.RateLimitError) as err:
                await limited.completions.create(model=MODEL, prompt="x" * 100, max_tokens=2)
            assert err.value.body["code"] == "rate_limit_exceeded" and quotas.refused_locally == 1
            assert counts.rejections == [("limited", "requests_per_minute")] * 2
            # The ledger counted both requests' prompt and generated tokens, as the usage says.
            await quotas.report()
            used = sum(o.usage.prompt_tokens + o.usage.completion_tokens for o in outs)
            assert quotas._ledger.usage("limited") == {"requests": 2, "tokens": used, "in_flight": 0}
            assert counts.generated["limited"] == 8 and counts.ttfts.count("limited") == 2

            # A tenant with no limits is never refused; a priority other than 0 needs the policy.
            for _ in range(3):
                await client("key-free").completions.create(model=MODEL, prompt="hi", max_tokens=1)
            with pytest.raises(openai.BadRequestError, match="priority"):
                await client("key-free").completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                                            extra_body={"priority": 3})
        import httpx2

        async with edge_app(engine, MODEL, IngressSettings(api_keys_file=str(path)), quotas=quotas) as app, \
                httpx2.AsyncClient(transport=httpx2.ASGITransport(app), base_url="http://edge") as http2:
            ant = anthropic.AsyncAnthropic(base_url="http://edge", api_key="wrong", max_retries=0, http_client=http2)
            with pytest.raises(anthropic.AuthenticationError) as aerr:
                await ant.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
            assert aerr.value.body["error"]["type"] == "authentication_error"
            ant = anthropic.AsyncAnthropic(base_url="http://edge", api_key="key-free", max_retries=0,
                                           http_client=http2)
            msg = await ant.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
            assert msg.usage.output_tokens >= 1

    asyncio.run(run())
    asyncio.run(quotas.report())
    # Counted per tenant before the limits; the 403 never reached them.
    assert counts.requests == {"limited": 4, "free": 5}


class RemoteLedger:
    """A `QuotaLedger` behind `.remote()` calls, as replicas reach the Quotas deployment."""

    class _Method:
        def __init__(self, fn: Any) -> None:
            self._fn = fn

        def remote(self, *args: Any) -> Any:
            async def call() -> Any:
                result = self._fn(*args)
                return await result if inspect.isawaitable(result) else result
            return call()

    def __init__(self, ledger: QuotaLedger) -> None:
        self.acquire = self._Method(ledger.acquire)
        self.report = self._Method(ledger.report)


class GatedLedger(RemoteLedger):
    """A `RemoteLedger` whose `method` ("acquire" or "report") reaches the ledger only while
    `gate` is open; `calls` counts the calls made to it."""

    def __init__(self, ledger: QuotaLedger, method: str) -> None:
        super().__init__(ledger)
        self.gate, self.calls = asyncio.Event(), 0
        direct = getattr(ledger, method)

        async def gated(*args: Any) -> Any:
            self.calls += 1
            await self.gate.wait()
            return direct(*args)
        setattr(self, method, self._Method(gated))


def test_replicas_admit_far_from_a_limit_on_their_own_and_never_past_it() -> None:
    ledger = QuotaLedger()
    replicas = [Quotas(RemoteLedger(ledger)), Quotas(RemoteLedger(ledger))]
    tenant = parse_keys(keys_yaml(a={"max_concurrency": 8, "requests_per_minute": 1000}))[hash_key("key-a")]

    async def run() -> list[str | None]:
        leases = []
        for r in replicas:  # the first request of each asks the ledger
            leases.append(await r.admit(tenant, 3))
        for r in replicas:  # a report brings back the replica's allowance: 8 / (2 x 2) requests in flight
            await r.report()
        for _ in range(6):  # then each admits 2 alone, then asks, and the ledger stops at the cap
            for r in replicas:
                try:
                    leases.append(await r.admit(tenant, 3))
                except Exception as exc:
                    assert getattr(exc, "status", None) == 429
                    leases.append(None)
        for r in replicas:
            await r.report()
        return leases

    leases = asyncio.run(run())
    held = [lease for lease in leases if lease]
    assert len(held) == 8 and len(set(held)) == 8  # up to the cap, no further
    assert [r.admitted_locally for r in replicas] == [2, 2]
    assert ledger.usage("a") == {"requests": 8, "tokens": 24, "in_flight": 8}


def test_an_allowance_is_reserved_until_it_lapses() -> None:
    clock = Clock()
    ledger = QuotaLedger(clock=clock)
    limits = Limits(max_concurrency=4)
    view = ledger.report("idle-replica", {}, [], limits={"a": limits})
    assert view.allowances == {"a": (UNLIMITED, UNLIMITED, 2)}  # 4 / (2 x 1 replica)
    # While the allowance stands, the others may take only what it leaves.
    assert [ledger.acquire("a", limits, 1, "busy").lease is not None for _ in range(3)] == [True, True, False]
    clock.t += ALLOWANCE_TTL_S + 0.1  # the idle replica never used it: it lapses
    assert ledger.acquire("a", limits, 1, "busy").lease is not None


def test_priorities_reach_the_engine_from_the_request_or_the_tenant(tmp_path: Path) -> None:
    from model.config import EngineConfig
    from model.engine.builder import build_engine

    directory = write_tiny_llama(tmp_path / "tiny", vocab_size=300)
    engine = build_engine(str(directory), EngineConfig(num_kv_blocks=64, max_num_seqs=4, scheduling_policy="priority"),
                    device="cpu", dtype="float32")
    seen: list[tuple[int, str | None]] = []
    add = engine.add_request

    def recording_add(*args: Any, priority: int = 0, tenant: str | None = None, **kwargs: Any) -> Any:
        seen.append((priority, tenant))
        return add(*args, priority=priority, tenant=tenant, **kwargs)

    engine.add_request = recording_add
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(batch={"priority": 5}))

    async def run() -> None:
        async with edge_app(engine, MODEL, IngressSettings(api_keys_file=str(path)), quotas=Quotas(None),
                            priority_scheduling=True) as app, \
                httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://edge", timeout=60) as http:
            oai = openai.AsyncOpenAI(base_url="http://edge/v1", api_key="key-batch", http_client=http, max_retries=0)
            await oai.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=1, extra_body={"priority": -2})
            await oai.responses.create(model=MODEL, input="hi", max_output_tokens=1, extra_body={"priority": 1})

    asyncio.run(run())
    assert seen == [(5, "batch"), (-2, "batch"), (1, "batch")]


def test_a_slot_given_back_is_free_for_the_next_request_at_once_and_an_outage_lets_requests_through() -> None:
    ledger = QuotaLedger()
    replica = Quotas(RemoteLedger(ledger))
    tenant = parse_keys(keys_yaml(a={"max_concurrency": 1}))[hash_key("key-a")]

    async def run() -> None:
        for _ in range(3):  # one stream after another at the cap: no report between them
            lease = await replica.admit(tenant, 2)
            assert lease is not None and ledger.usage("a")["in_flight"] == 1
            replica.release(lease, tenant)
        broken = RemoteLedger(ledger)

        def down(*args: Any) -> Any:
            raise ConnectionError("ledger gone")
        broken.acquire = RemoteLedger._Method(down)
        replica._ledger = broken
        assert await replica.admit(tenant, 2) is None  # admitted unchecked, counted as an error
        assert replica.errors == 1 and replica._released  # the last release is kept for the next call

    asyncio.run(run())
    assert ledger.usage("a")["in_flight"] == 1  # the last lease: its release waits for the ledger


def test_a_lease_admitted_here_and_given_back_before_its_report_is_not_leaked() -> None:
    ledger = QuotaLedger()
    replica = Quotas(RemoteLedger(ledger))
    tenant = parse_keys(keys_yaml(a={"max_concurrency": 8}))[hash_key("key-a")]

    async def run() -> None:
        replica.release(await replica.admit(tenant, 1), tenant)  # asks the ledger
        await replica.report()  # the allowance: 8 / (2 x 1) = 4
        local = await replica.admit(tenant, 1)
        assert replica.admitted_locally == 1
        replica.release(local, tenant)  # before the report that tells the ledger of it
        for _ in range(4):  # past the allowance: these ask, carrying the releases the ledger knows
            replica.release(await replica.admit(tenant, 1), tenant)
        await replica.report()
        await replica.report()

    asyncio.run(run())
    assert ledger.usage("a")["in_flight"] == 0


def test_a_release_does_not_overtake_the_report_that_registers_its_lease() -> None:
    ledger = QuotaLedger()
    remote = GatedLedger(ledger, "report")  # an acquire while a report waits at the gate goes first
    replica = Quotas(remote)
    tenant = parse_keys(keys_yaml(a={"max_concurrency": 8}))[hash_key("key-a")]

    async def run() -> None:
        replica.release(await replica.admit(tenant, 1), tenant)
        remote.gate.set()
        await replica.report()  # the allowance
        remote.gate.clear()
        local = await replica.admit(tenant, 1)
        assert replica.admitted_locally == 1
        reporting = asyncio.create_task(replica.report())  # carries the local lease, held at the gate
        await asyncio.sleep(0)
        replica.release(local, tenant)
        for _ in range(4):  # past the allowance: these ask the ledger while the report waits
            replica.release(await replica.admit(tenant, 1), tenant)
        remote.gate.set()
        await reporting
        await replica.report()
        await replica.report()

    asyncio.run(run())
    assert ledger.usage("a")["in_flight"] == 0


def test_a_burst_of_a_refused_tenant_asks_the_ledger_once() -> None:
    """Requests of one tenant that arrive while its request ahead asks the ledger wait for that
    answer: a refusal answers them all (one ledger call for a burst of retries, not one each);
    after a grant each asks for its own lease."""
    ledger = QuotaLedger()
    remote = GatedLedger(ledger, "acquire")
    replica = Quotas(remote)
    tenant = parse_keys(keys_yaml(a={"max_concurrency": 2}))[hash_key("key-a")]

    async def admit() -> str | int:
        try:
            return await replica.admit(tenant, 1)
        except Exception as exc:  # noqa: BLE001
            return getattr(exc, "status", -1)

    async def settle() -> None:
        """Let every task run to where it waits (the gate, or the answer ahead): no clock involved."""
        for _ in range(10):
            await asyncio.sleep(0)

    async def run() -> None:
        remote.gate.set()
        held = [await admit(), await admit()]  # the tenant's two slots
        assert all(isinstance(lease, str) for lease in held) and remote.calls == 2
        remote.gate.clear()
        replica._refused.clear()  # as once REFUSAL_TTL_S has passed: the next request asks again
        burst = [asyncio.create_task(admit()) for _ in range(8)]
        await settle()
        assert remote.calls == 3  # the first asks; the seven behind it wait for its answer
        remote.gate.set()
        assert await asyncio.gather(*burst) == [429] * 8 and remote.calls == 3
        for lease in held:
            replica.release(lease, tenant)  # a slot of its own is free: the next ones ask again
        remote.gate.clear()
        burst = [asyncio.create_task(admit()) for _ in range(3)]
        await settle()
        assert remote.calls == 4
        remote.gate.set()
        answers = await asyncio.gather(*burst)
        # The first's grant answers nobody else: the two behind it asked for their own.
        assert remote.calls == 6 and sum(isinstance(a, str) for a in answers) == 2 and answers.count(429) == 1

    asyncio.run(run())
