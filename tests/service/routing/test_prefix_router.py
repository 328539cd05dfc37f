"""The prefix-aware request router's choices, without a cluster: a known prefix goes to the
replica that got it, unless that replica is much busier; unknown prompts get two candidates.
LoRA adapters: the prefix chain is salted by the adapter, a request for an adapter prefers a
replica holding it (reported resident, or sent it before), and a burst for a new one stays on one."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID
from ray.serve.request_router import ReplicaID

from model.sampling.params import SamplingParams
from service.engine.engine_loop import SubRequest
from service.routing.router import PrefixAwareRouter

DEPLOYMENT = DeploymentID(name="EngineDeployment", app_name="qkv")
DEPLOYMENT_SOURCE = DeploymentHandleSource.UNKNOWN
PREFIX = list(range(40))  # 10 full blocks of 4


@dataclass
class FakeReplica:
    replica_id: ReplicaID
    max_ongoing_requests: int = 100
    routing_stats: dict = field(default_factory=dict)  # what record_routing_stats reported
    replica_metadata: dict = field(default_factory=dict)  # what record_replica_metadata reported


def pending(rid: str, prompt: list[int], lora: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(args=[[SubRequest(rid, prompt, SamplingParams(), lora)]], kwargs={},
                           metadata=SimpleNamespace(internal_request_id=rid))


def pick(prompt: list[int], lora: str | None = None) -> SimpleNamespace:
    """A pick-only call as service/routing/prefix_route.py makes it (a `RoutingPrompt` look-alike)."""
    return SimpleNamespace(args=[SimpleNamespace(prompt_token_ids=prompt, lora=lora)], kwargs={},
                           metadata=SimpleNamespace(internal_request_id="pick"))


def replicas(*names: str) -> list[FakeReplica]:
    return [FakeReplica(ReplicaID(name, DEPLOYMENT)) for name in names]


def router(**kwargs) -> PrefixAwareRouter:
    r = PrefixAwareRouter(DEPLOYMENT, DEPLOYMENT_SOURCE)
    r.initialize_state(**{"block_size": 4, **kwargs})
    return r


def ids(ranks: list[list[FakeReplica]]) -> list[list[str]]:
    return [sorted(r.replica_id.unique_id for r in rank) for rank in ranks]


def test_routes_by_prefix_unless_the_holder_is_much_busier() -> None:
    async def scenario() -> None:
        router = PrefixAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(block_size=4, imbalance_threshold=2)
        a, b = (FakeReplica(ReplicaID(name, DEPLOYMENT)) for name in ("a", "b"))
        both = [a, b]
        # Nothing known: power of two choices over both.
        assert ids(await router.choose_replicas(both, pending("r0", PREFIX + [1]))) == [["a", "b"]]
        router.on_request_routed(pending("r0", PREFIX + [1]), b.replica_id, None)
        # Same prefix, another suffix: "b" first, "a" as the fallback rank.
        assert ids(await router.choose_replicas(both, pending("r1", PREFIX + [2, 3]))) == [["b"], ["a"]]
        # A different first block shares nothing; a prompt shorter than a block has no prefix.
        assert ids(await router.choose_replicas(both, pending("r2", [99] + PREFIX))) == [["a", "b"]]
        assert ids(await router.choose_replicas(both, pending("r3", [1, 2]))) == [["a", "b"]]
        # "b" gets 3 more requests in flight than "a" (threshold 2): balance by load instead.
        for i in range(3):
            router.on_request_routed(pending(f"busy{i}", [7, 7]), b.replica_id, None)
        assert ids(await router.choose_replicas(both, pending("r4", PREFIX))) == [["a", "b"]]
        router.on_request_completed(b.replica_id, "busy0")
        router.on_request_completed(b.replica_id, "r0")
        assert ids(await router.choose_replicas(both, pending("r5", PREFIX))) == [["b"], ["a"]]
        # A replica that is gone is never chosen for the prefix it held.
        assert ids(await router.choose_replicas([a], pending("r6", PREFIX))) == [["a"]]

    asyncio.run(scenario())


def test_a_pick_only_routing_prompt_is_remembered_by_its_shape_not_its_class() -> None:
    """HAProxy's path (service/routing/prefix_route.py): nothing is dispatched through the router, so the
    pick itself makes the owner. Serve ships the router by value, so the argument's class is a
    different object from the router's own `RoutingPrompt`: any object with the ids counts."""
    async def scenario() -> None:
        router = PrefixAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(block_size=4)
        a, b = (FakeReplica(ReplicaID(name, DEPLOYMENT)) for name in ("a", "b"))
        request = lambda: SimpleNamespace(args=[SimpleNamespace(prompt_token_ids=PREFIX + [9])], kwargs={},  # noqa: E731
                                          metadata=SimpleNamespace(internal_request_id="x"))
        (first,) = (await router.choose_replicas([a, b], request()))[0][:1]
        for _ in range(5):  # no on_request_routed: the first pick still owns the prefix
            assert (await router.choose_replicas([a, b], request()))[0] == [first]

    asyncio.run(scenario())


def test_the_prefix_chain_is_salted_by_the_adapter() -> None:
    async def scenario() -> None:
        r = router(imbalance_threshold=2)
        a, b = both = replicas("a", "b")
        r.on_request_routed(pending("r0", PREFIX + [1], lora="x"), b.replica_id, None)
        # The same prompt under adapter "x" again: the holder; for the base model or adapter "y": nothing known.
        assert ids(await r.choose_replicas(both, pending("r1", PREFIX + [2], lora="x"))) == [["b"], ["a"]]
        assert ids(await r.choose_replicas(both, pending("r2", PREFIX + [2]))) == [["a", "b"]]
        assert ids(await r.choose_replicas(both, pending("r3", PREFIX + [2], lora="y"))) == [["a", "b"]]
        # And the base model's prefix does not attract "y" either.
        r.on_request_routed(pending("r4", PREFIX), a.replica_id, None)
        assert ids(await r.choose_replicas(both, pending("r5", PREFIX, lora="y"))) == [["a", "b"]]
        assert ids(await r.choose_replicas(both, pending("r6", PREFIX + [3]))) == [["a"], ["b"]]

    asyncio.run(scenario())


def test_an_adapter_goes_to_a_replica_holding_it_unless_it_is_much_busier() -> None:
    async def scenario() -> None:
        r = router(imbalance_threshold=2)
        a, b, c = three = replicas("a", "b", "c")
        b.routing_stats = {"num_requests": 1, "lora_adapters": ["x"]}
        c.routing_stats = {"num_requests": 0, "lora_adapters": ["x", "z"]}
        # Both holders of "x", the less busy first; then the replica without it.
        assert [[rep.replica_id.unique_id for rep in rank]
                for rank in await r.choose_replicas(three, pending("r0", [5, 6], lora="x"))] == [["c", "b"], ["a"]]
        assert ids(await r.choose_replicas(three, pending("r1", [5, 6], lora="z"))) == [["c"], ["a", "b"]]
        # A prefix known under "x" wins over the adapter's other holders.
        r.on_request_routed(pending("r2", PREFIX, lora="x"), b.replica_id, None)
        assert ids(await r.choose_replicas(three, pending("r3", PREFIX + [1], lora="x"))) == [["b"], ["a", "c"]]
        # "c", the only holder of "z", has 3 more requests than "a" (threshold 2): by load instead.
        c.routing_stats = {"num_requests": 3, "lora_adapters": ["x", "z"]}
        got = await r.choose_replicas(three, pending("r4", [5, 6], lora="z"))
        assert len(got) == 1 and len(got[0]) == 2  # power of two choices over all three
        # Requests for the base model ignore adapters.
        assert len((await r.choose_replicas(three, pending("r5", [5, 6])))[0]) == 2

    asyncio.run(scenario())


@pytest.mark.parametrize("route_by_prefix", [True, False])
def test_a_burst_for_a_new_adapter_stays_on_one_replica(route_by_prefix: bool) -> None:
    """HAProxy's pick-only path: the first pick of an adapter no replica holds is remembered, so
    the burst that follows (before any replica reports it resident) lands on that one replica;
    the pick is a rank of one replica (Serve would take the shortest queue within a rank)."""
    async def scenario() -> None:
        r = router(imbalance_threshold=8, route_by_prefix=route_by_prefix)
        four = replicas("a", "b", "c", "d")
        firsts = set()
        for i in range(8):
            ranks = await r.choose_replicas(four, pick([100 + i] * 9, lora="new"))
            assert len(ranks[0]) == 1
            firsts.add(ranks[0][0].replica_id.unique_id)
        assert len(firsts) == 1, firsts
        # Replicas report their loads: the holder is now 9 requests above the others, past the threshold.
        (holder,) = firsts
        for rep in four:
            rep.routing_stats = {"num_requests": 9 if rep.replica_id.unique_id == holder else 0,
                                 "lora_adapters": ["new"] if rep.replica_id.unique_id == holder else []}
        spill = (await r.choose_replicas(four, pick([1, 2, 3], lora="new")))[0][0].replica_id.unique_id
        assert spill != holder
        # ...and the spill-over replica is remembered for the adapter too.
        assert (await r.choose_replicas(four, pick([4, 5, 6], lora="new")))[0][0].replica_id.unique_id == spill

    asyncio.run(scenario())


def test_a_pick_only_call_is_told_why_its_replica_was_chosen() -> None:
    """`RoutingPrompt.picked_by`: what service/routing/prefix_route.py records for each request (the
    end-to-end adapter test reads it): "load" with nothing known, "adapter" for a replica holding
    the adapter, "prefix" for the replica that computed the leading blocks; by load again once the
    holder is past the imbalance threshold."""
    from service.routing.router import RoutingPrompt

    async def scenario() -> None:
        r = router(imbalance_threshold=2)
        a, b = both = replicas("a", "b")

        async def why(prompt: list[int], lora: str | None = None) -> tuple[str, str]:
            argument = RoutingPrompt(prompt, lora)
            ranks = await r.choose_replicas(both, SimpleNamespace(args=[argument], kwargs={},
                                                                  metadata=SimpleNamespace(internal_request_id="x")))
            (reason,) = argument.picked_by
            return reason, ranks[0][0].replica_id.unique_id

        reason, first = await why([1, 2, 3, 4, 5], lora="x")
        assert reason == "load"
        assert await why([9, 9, 9, 9, 9], lora="x") == ("adapter", first)  # another prompt, the same adapter
        assert await why([1, 2, 3, 4, 6], lora="x") == ("prefix", first)  # its first block under "x"
        assert (await why([7, 7, 7, 7, 7]))[0] == "load"  # the base model, a new prefix
        holder = a if first == "a" else b
        holder.routing_stats = {"num_requests": 3, "lora_adapters": ["x"]}  # 3 above the other (threshold 2)
        assert await why([8, 8, 8, 8, 8], lora="x") == ("load", (b if holder is a else a).replica_id.unique_id)

    asyncio.run(scenario())


def test_without_prefix_routing_a_shared_prefix_routes_by_load() -> None:
    async def scenario() -> None:
        r = router(route_by_prefix=False)
        a, b = both = replicas("a", "b")
        r.on_request_routed(pending("r0", PREFIX), b.replica_id, None)
        assert ids(await r.choose_replicas(both, pending("r1", PREFIX + [1]))) == [["a", "b"]]

    asyncio.run(scenario())


def test_a_call_that_names_a_model_goes_to_that_models_replicas_only() -> None:
    """A multi-model deployment (service/app/multi.py): a pick or a `ToModel` call chooses among the
    replicas whose metadata names the model, by prefix within them (chained per model, so two models
    with the same tokenizer never share an owner), and none is chosen while the model has none."""
    from service.routing.router import RoutingPrompt, ToModel

    async def scenario() -> None:
        r = router(imbalance_threshold=8, model_block_sizes={"beta": 8})
        a1, a2, b1, b2 = reps = replicas("a1", "a2", "b1", "b2")
        for rep, model in zip(reps, ("alpha", "alpha", "beta", "beta")):
            rep.replica_metadata = {"model": model}

        def call(arg: object) -> SimpleNamespace:
            return SimpleNamespace(args=[arg], kwargs={}, metadata=SimpleNamespace(internal_request_id="x"))

        for _ in range(10):
            assert {x.replica_id.unique_id for rank in await r.choose_replicas(reps, call(ToModel("beta")))
                    for x in rank} == {"b1", "b2"}
        (first,) = (await r.choose_replicas(reps, call(RoutingPrompt(PREFIX, None, "alpha"))))[0][:1]
        assert first.replica_id.unique_id in {"a1", "a2"}
        for _ in range(5):  # the prefix stays with its alpha replica
            ranks = await r.choose_replicas(reps, call(RoutingPrompt(PREFIX + [7], None, "alpha")))
            assert ranks[0] == [first] and {x.replica_id.unique_id for x in ranks[1]} == {"a1", "a2"} - {
                first.replica_id.unique_id}
        # The same ids under beta (block size 8) are another chain: a load pick among beta's replicas.
        picks = {(await r.choose_replicas(reps, call(RoutingPrompt(PREFIX + [9], None, "beta"))))[0][0]
                 .replica_id.unique_id for _ in range(3)}
        assert picks <= {"b1", "b2"}
        assert await r.choose_replicas([a1, a2], call(ToModel("beta"))) == []  # beta has no replica up
        assert {x.replica_id.unique_id for rank in await r.choose_replicas(reps, call(RoutingPrompt(PREFIX)))
                for x in rank} <= {"a1", "a2", "b1", "b2"}  # no model named: any replica

    asyncio.run(scenario())


def test_a_call_that_names_a_replica_goes_to_that_replica_or_waits_for_it() -> None:
    """A replica fetching KV blocks from a peer (service/replica/peer_fetch.py) names it: whatever
    the loads and prefixes, that replica only, and none while it is not among the running ones."""
    from service.replica.peer_fetch import ToReplica

    async def scenario() -> None:
        r = router()
        a, b, c = reps = replicas("a", "b", "c")
        a.routing_stats, b.routing_stats = {"num_requests": 50}, {"num_requests": 0}
        call = SimpleNamespace(args=[ToReplica("a"), PREFIX, None], kwargs={},
                               metadata=SimpleNamespace(internal_request_id="x"))
        for _ in range(5):
            assert ids(await r.choose_replicas(reps, call)) == [["a"]]
        assert await r.choose_replicas([b, c], call) == []

    asyncio.run(scenario())


def test_with_the_kv_index_answer_the_router_goes_by_what_the_engines_hold() -> None:
    """`RoutingPrompt.held` (the KV index's answer, service/routing/prefix_route.py): the replica
    that holds the longest run wins, though this router sent the prefix elsewhere; an empty answer
    (evicted everywhere) is a pick by load, not by the router's stale record; a holder past the
    imbalance threshold is left."""
    from service.routing.router import RoutingPrompt

    async def scenario() -> None:
        r = router(imbalance_threshold=2)
        a, b, c = reps = replicas("a", "b", "c")

        async def choose(prompt: list[int], held: dict[str, int] | None) -> tuple[str, str]:
            argument = RoutingPrompt(prompt, held=held)
            ranks = await r.choose_replicas(reps, SimpleNamespace(args=[argument], kwargs={},
                                                                  metadata=SimpleNamespace(internal_request_id="x")))
            return argument.picked_by[0], ranks[0][0].replica_id.unique_id

        why, first = await choose(PREFIX, None)  # no index: by load, remembered as the prefix's owner
        assert why == "load"
        assert await choose(PREFIX, None) == ("prefix", first)
        other = next(x for x in "abc" if x != first)
        assert await choose(PREFIX, {other: 10, first: 2}) == ("prefix", other)  # the engines, not the record
        assert (await choose(PREFIX, {}))[0] == "load"  # nobody holds it any more
        assert await choose(PREFIX, {"a": 6, "c": 6}) in (("prefix", "a"), ("prefix", "c"))  # tied: either
        c.routing_stats = {"num_requests": 1}
        assert await choose(PREFIX, {"a": 6, "c": 6}) == ("prefix", "a")  # tied: the less busy
        a.routing_stats = {"num_requests": 5}  # 5 above b (threshold 2): the holder is left
        assert (await choose(PREFIX, {"a": 9}))[0] == "load"

    asyncio.run(scenario())
