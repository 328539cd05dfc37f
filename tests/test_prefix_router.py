"""The prefix-aware request router's choices, without a cluster: a known prefix goes to the
replica that got it, unless that replica is much busier; unknown prompts get two candidates."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID
from ray.serve.request_router import ReplicaID

from model.sampling.params import SamplingParams
from service.engine_loop import SubRequest
from service.router import PrefixAwareRouter

DEPLOYMENT = DeploymentID(name="EngineDeployment", app_name="qkv")
PREFIX = list(range(40))  # 10 full blocks of 4


@dataclass
class FakeReplica:
    replica_id: ReplicaID
    max_ongoing_requests: int = 100


def pending(rid: str, prompt: list[int]) -> SimpleNamespace:
    return SimpleNamespace(args=[[SubRequest(rid, prompt, SamplingParams())]], kwargs={},
                           metadata=SimpleNamespace(internal_request_id=rid))


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
    """HAProxy's path (service/prefix_route.py): nothing is dispatched through the router, so the
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
