"""The one-model application: `compose_app` turns `AppArgs` into the engine deployment (each
replica an engine and its own HTTP edge) and, when HAProxy picks among several replicas with
prefix caching or LoRA adapters on, the `PrefixRoute` deployment it asks which one
(service/routing/prefix_route.py). Without HAProxy, Serve's Python proxy forwards to the replicas
and picks them by load alone. A multi-model app (`service/app/multi.py`) builds each model's
engine deployment here."""

# No `from __future__ import annotations`: Serve reads the builder's annotation as a class.

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import ray
from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from model.config import EngineConfig
from model.engine.builder import check_sizing
from service.app.args import AppArgs, use_gpu
from service.autoscaling import serve_autoscaling_config
from service.launch import haproxy_enabled
from service.replica.engine_deployment import EngineBackend, EngineDeployment, PrefillDeployment
from service.replica.placement import engine_device, replica_resources, warn_if_unplaceable
from service.routing.kv_index_deployment import KVIndexDeployment
from service.routing.prefix_route import PrefixRoute
from service.server.api import API_KEY_ENV, IngressSettings
from service.tenancy.ledger import QuotaLedgerDeployment

logger = logging.getLogger(__name__)


# Requests Serve itself lets into a replica beyond its admission bound: /health, /v1/models and
# the like, which the bound does not count, are never refused by Serve with a bare text body.
SERVE_HEADROOM = 64
UNBOUNDED_ONGOING = 100_000  # Serve needs a number where the admission bound is "none"


def wants_prefix_router(args: AppArgs, behind_front: bool = False) -> bool:
    """Whether HAProxy should ask `PrefixRoute` for each request's replica (or, `behind_front`, the
    multi-model front's handle should pick by prefix): several replicas, and prefix caching or LoRA
    adapters to route by."""
    return (args.enable_prefix_caching or serves_lora(args)) and args.prefix_aware_routing \
        and args.max_engine_replicas() > 1 and (behind_front or haproxy_enabled())


def router_options(args: AppArgs, **router_kwargs: Any) -> dict[str, Any]:
    """Deployment options for the engine with the prefix router: `PrefixAwareRouter` (service/routing/router.py),
    weighing replicas by the load (and resident adapters) each reports every second; `router_kwargs`
    add to (or replace) its `initialize_state` arguments."""
    kwargs = {"block_size": args.block_size, "imbalance_threshold": args.routing_imbalance_threshold,
              "tier_imbalance_threshold": args.routing_tier_imbalance_threshold,
              "route_by_prefix": args.enable_prefix_caching, **router_kwargs}
    return {"request_router_config": RequestRouterConfig(
        request_router_class="service.routing.router.PrefixAwareRouter", request_router_kwargs=kwargs,
        request_routing_stats_period_s=1.0, request_routing_stats_timeout_s=5.0)}


def serves_lora(args: AppArgs) -> bool:
    return bool(args.lora_modules or args.lora_dynamic_path)


def compose_app(args: AppArgs, engine_wrapper: Callable[[Any], Any] | None = None,
                deployment_name: str | None = None) -> serve.Application:
    """`build_app` with an optional `engine_wrapper(engine) -> engine` applied in each replica.

    The wrapper is a Python callable, so no config file or command line can set it: tests use
    it to inject faults (tests/support/fault_injection.py). `deployment_name`: one model of a multi-model
    app behind its front (service/app/multi.py), reached through the front's handle: the engine
    deployment alone, under that name, its request router (when wanted) picking for the handle.
    """
    prefix_router = wants_prefix_router(args, behind_front=deployment_name is not None)
    options = engine_options(args)
    init = engine_init(args, engine_wrapper)
    if args.prefill_replicas:  # prefill/decode disaggregation (service/replica/kv_connector.py)
        prefill = args.model_copy(update={"engine_num_cpus": args.prefill_num_cpus or args.engine_num_cpus,
                                          "num_replicas": args.prefill_replicas, "autoscaling_config": None})
        init |= {"prefill": PrefillDeployment.options(**engine_options(prefill)).bind(**engine_init(prefill, engine_wrapper)),
                 "prefill_min_tokens": args.prefill_min_tokens, "prefill_timeout_s": args.prefill_timeout_s}
    if args.api_keys_file and "quotas" not in init:  # the tenants' counts, one ledger for every replica
        init["quotas"] = QuotaLedgerDeployment.bind()
    kv_index = KVIndexDeployment.bind(args.resolved_name()) if prefix_router and args.kv_cache_index and not deployment_name else None
    if kv_index is not None:  # the engines publish what their caches hold; the prefix route asks it
        # (events only where they are drained: a log nobody reads would grow without end)
        init |= {"kv_index": kv_index, "engine_config": init["engine_config"] | {"enable_kv_cache_events": True},
                 "kv_remote_fetch": args.kv_remote_fetch, "kv_remote_fetch_min_tokens": args.kv_remote_fetch_min_tokens,
                 "kv_remote_fetch_timeout_s": args.kv_remote_fetch_timeout_s}
    engine = (EngineBackend.options(name=deployment_name) if deployment_name else EngineDeployment).options(
        **options, **(router_options(args) if prefix_router else {}),
    ).bind(**init)
    scaling = options.get("autoscaling_config") or {"num_replicas": options.get("num_replicas")}
    logger.info("building %s on %s: %s, admission %d per replica, %s, api key %s", args.resolved_name(),
                "GPU" if use_gpu(args.accelerator) else "CPU", scaling, args.admission(),
                "HAProxy" + (" with the prefix router" if prefix_router else "") if haproxy_enabled()
                else "Serve's proxy", "keys file" if args.api_keys_file else "on" if ingress_settings(args).api_key
                else "off")
    if not prefix_router or deployment_name:
        return engine
    router = PrefixRoute.options(ray_actor_options={"num_cpus": args.router_num_cpus})
    return engine._with_ingress_request_router(router.bind(engine, kv_index=kv_index))


def engine_options(args: AppArgs) -> dict[str, Any]:
    """The engine deployment's Serve options (resources, limits, scaling), without its request router."""
    config = EngineConfig(**args.engine_config())  # fail here, not in a replica, on bad knobs
    # ... and on a max_model_len the KV cache cannot hold, where that is known before a replica starts
    check_sizing(args.model, config, "cuda" if use_gpu(args.accelerator) else "cpu", args.dtype, args.revision)
    resources = replica_resources(args.engine_num_cpus, use_gpu(args.accelerator), args.tensor_parallel_size,
                                  args.tp_worker_num_cpus, args.placement_group_strategy)
    if ray.is_initialized():
        warn_if_unplaceable(resources, ray.cluster_resources())
    scaling: dict[str, Any] = ({"autoscaling_config": args.autoscaling_config} if args.autoscaling_config
                               else {"num_replicas": args.num_replicas})
    if args.autoscaling_config and args.autoscaling_target_ttft_s is not None:  # the replicas' TTFT and queue
        scaling = {"autoscaling_config": serve_autoscaling_config(args.autoscaling_config, args.scaling_targets())}
    capacity = args.admission()
    return dict(
        **resources,
        # The replica's own admission gate is the bound (and answers in the API's error shape);
        # Serve's limits sit above it.
        max_ongoing_requests=UNBOUNDED_ONGOING if capacity == -1 else capacity + SERVE_HEADROOM,
        # Unbounded at Serve: under a burst it counts requests not yet started as queued and
        # would drop them with a bare text body though the gate has room.
        max_queued_requests=-1,
        backpressure_config=BackpressureConfig(status_code=args.overload_status, retry_after_s=args.retry_after_s),
        graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s,
        **scaling,
    )


def ingress_settings(args: AppArgs) -> IngressSettings:
    """What the replica's HTTP edge enforces, from the arguments."""
    return IngressSettings(
        api_key=None if args.api_keys_file else args.api_key or os.environ.get(API_KEY_ENV) or None,
        api_keys_file=args.api_keys_file,
        max_body_bytes=args.max_body_bytes,
        max_header_bytes=args.max_header_bytes,
        request_timeout_s=args.request_timeout_s,
        max_attention_floats=args.max_attention_floats,
        max_images_per_request=args.limit_mm_per_prompt.get("image", 8),
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=tuple(args.allowed_media_domains or ()),
        image_fetch_timeout_s=args.image_fetch_timeout_s,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        overload_status=args.overload_status,
        retry_after_s=args.retry_after_s,
        admission_capacity=args.admission(),
        batch_dir=args.batch_dir,
        batch_max_file_bytes=args.batch_max_file_bytes,
        batch_max_lines=args.batch_max_lines,
        batch_concurrency=args.batch_concurrency,
        batch_offline_min_lines=args.batch_offline_min_lines,
        batch_offline_concurrency=args.batch_offline_concurrency,
        batch_offline_num_cpus=args.batch_offline_num_cpus,
        batch_offline_num_gpus=args.batch_offline_num_gpus,
    )


def engine_init(args: AppArgs, engine_wrapper: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """The engine replica's constructor arguments (`EngineReplica.__init__`)."""
    gpu = use_gpu(args.accelerator)
    return dict(
        model=args.model,
        served_model_name=args.resolved_name(),
        engine_config=args.engine_config(),
        settings=dataclasses.asdict(ingress_settings(args)),
        device=engine_device(gpu, args.tensor_parallel_size),
        dtype=args.dtype,
        seed=args.seed,
        torch_threads=args.torch_threads or (None if gpu else max(1, int(args.engine_num_cpus))),
        engine_wrapper=engine_wrapper,
        revision=args.revision,
        stall_timeout_s=args.stall_timeout_s,
        stream_interval_ms=args.stream_interval_ms,
        ttft_window_s=args.autoscaling_ttft_window_s,
    )
