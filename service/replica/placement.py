"""Where an engine replica and its tensor-parallel workers run: the deployment's resource options.

With `tensor_parallel_size` 1 a replica is one Ray actor holding the whole model (and one GPU on a
GPU cluster). With `tensor_parallel_size` N > 1 the engine inside the replica starts N worker
actors, one per rank (model/engine/parallel/), and Serve reserves a placement group *per
replica* for them (`placement_group_bundles`): bundle 0 is the replica itself (CPUs only, its
scheduler, sampler and HTTP edge), bundles 1..N are the workers (CPUs, and one GPU each on GPU).
Because Serve creates and removes the group with the replica, autoscaling adds whole groups and a
replaced replica (its check_health failed: a dead worker) gets a new group and new workers.

The strategy is Ray's: PACK (the default, as Ray Serve LLM's) puts the bundles on as few nodes as
possible and spills to others when one node cannot hold them; STRICT_PACK refuses to span nodes
(the group waits until one node fits it: what NVLink-bound tensor parallelism wants); SPREAD and
STRICT_SPREAD put the bundles on distinct nodes.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

logger = logging.getLogger(__name__)

PlacementStrategy = Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"]


def worker_bundle(tp_worker_num_cpus: float, gpu: bool) -> dict[str, float]:
    """The resources of one tensor-parallel worker (one rank)."""
    return {"CPU": tp_worker_num_cpus, "GPU": 1} if gpu else {"CPU": tp_worker_num_cpus}


def replica_resources(engine_num_cpus: float, gpu: bool, tensor_parallel_size: int = 1,
                      tp_worker_num_cpus: float = 1.0, strategy: PlacementStrategy = "PACK") -> dict[str, Any]:
    """The engine deployment's resource options: `ray_actor_options`, and with tensor parallelism
    the per-replica `placement_group_bundles` and `placement_group_strategy`."""
    if tensor_parallel_size == 1:
        return {"ray_actor_options": {"num_cpus": engine_num_cpus, "num_gpus": 1 if gpu else 0}}
    # Serve schedules the replica in bundle 0, so its actor options must fit in that bundle; the
    # GPUs are the workers', the replica's driver holds none.
    bundles = [{"CPU": engine_num_cpus}] + [worker_bundle(tp_worker_num_cpus, gpu)] * tensor_parallel_size
    return {"ray_actor_options": {"num_cpus": engine_num_cpus, "num_gpus": 0},
            "placement_group_bundles": bundles, "placement_group_strategy": strategy}


def engine_device(gpu: bool, tensor_parallel_size: int = 1) -> str:
    """The `device` the replica builds its engine with. A tensor-parallel replica holds no GPU
    itself: "auto" lets the engine keep its driver (the sampler) on the CPU and put its workers
    on the cluster's GPUs."""
    if not gpu:
        return "cpu"
    return "cuda" if tensor_parallel_size == 1 else "auto"


def warn_if_unplaceable(options: dict[str, Any], cluster: dict[str, float]) -> str | None:
    """A warning (logged and returned) when the cluster as it is now cannot hold one replica's
    placement group: Serve would wait for it forever, unless an autoscaler adds nodes."""
    bundles = options.get("placement_group_bundles")
    if not bundles:
        return None
    needed: dict[str, float] = {}
    for bundle in bundles:
        for resource, amount in bundle.items():
            needed[resource] = needed.get(resource, 0.0) + amount
    short = {r: (amount, cluster.get(r, 0.0)) for r, amount in needed.items() if cluster.get(r, 0.0) < amount}
    if not short:
        return None
    message = ("one engine replica's placement group needs " +
               ", ".join(f"{amount:g} {r} (the cluster has {have:g})" for r, (amount, have) in sorted(short.items())) +
               "; its replicas stay pending until nodes that fit it join the cluster")
    logger.warning(message)
    return message
