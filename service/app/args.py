"""`AppArgs`: the application's arguments, validated by Pydantic from a Serve config or the
command line. The engine's knobs take their default and description from `EngineConfig` (one
source); the docs' argument reference is generated from these fields (docs/generate.py).
"""

# No `from __future__ import annotations`: Serve reads the builder's annotation as a class.

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

import ray
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from model.config import (AttentionBackend, EngineConfig, KVCacheDtype, Quantization, QuantizationActivations,
                          QuantizationGroupSize, QuantizeLmHead, SchedulingPolicy)
from model.loading.hub import is_hub_id
from model.loading.loading import is_preset
from service.autoscaling import REPLACED_SERVE_KEYS, ScalingTargets
from service.batch.storage import check_url
from service.engine.admission import admission_capacity
from service.replica.placement import PlacementStrategy
from service.tenancy.keys import KeyTable

_ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def engine_arg(name: str, **constraints: Any) -> Any:
    """The app argument that is `EngineConfig.<name>`: its default and description are the
    engine's (one source); `constraints` are Pydantic's range checks (`ge=1`)."""
    f = _ENGINE_FIELDS[name]
    return Field(f.default, description=f.metadata["description"], **constraints)


class AppArgs(BaseModel):
    """Builder arguments: the model, where it runs, the engine's knobs, admission limits.

    The docs' argument reference is generated from these fields (docs/generate.py): each has a
    description, and the engine's knobs take theirs from `EngineConfig` (`engine_arg`).
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field("transformer-base-trained", description="A preset name, a checkpoint directory or an HF "
                       "hub id (`org/name`; a local directory of that name wins).")
    revision: str | None = Field(None, description="Of a hub id: a branch, tag or commit; None: main.")
    served_model_name: str | None = Field(None, description="The `model` clients send; None: the preset name, "
                                          "the hub id or the checkpoint directory's name.")
    accelerator: Literal["auto", "cpu", "gpu"] = Field("auto", description="gpu: one GPU per engine replica (per "
                                                       "rank with tensor parallelism); auto: gpu when torch is a "
                                                       "CUDA build and the cluster has GPUs, decided when the app "
                                                       "is built.")
    num_replicas: int = Field(1, ge=1, description="Engine replicas (each a whole engine and its HTTP edge).")
    prefill_replicas: int = Field(0, ge=0, description="Replicas of a separate `Prefill` deployment (prefill/decode "
                                  "disaggregation): the engine replicas fetch the KV blocks of long prompts from "
                                  "it instead of prefilling them. Same model and engine arguments. 0: none.")
    prefill_num_cpus: float | None = Field(None, gt=0, description="Ray CPUs of a prefill replica; None: "
                                           "engine_num_cpus.")
    prefill_min_tokens: int = Field(64, ge=1, description="Prompts shorter than this are prefilled by the engine "
                                    "replica itself, not the Prefill deployment.")
    prefill_timeout_s: float = Field(60.0, gt=0, description="How long an engine replica waits for the Prefill "
                                     "deployment (each of the call and the transfer) before prefilling the prompt "
                                     "itself.")
    autoscaling_config: dict[str, Any] | None = Field(None, description="Ray Serve's autoscaling_config "
                                                      "(min_replicas, max_replicas, target_ongoing_requests, ...); "
                                                      "replaces num_replicas when given.")
    # autoscaling on time to first token and queue (service/autoscaling.py)
    autoscaling_target_ttft_s: float | None = Field(None, gt=0, description="Scale the engine replicas on their own "
                                                    "time to first token (its p90 over autoscaling_ttft_window_s) "
                                                    "and queue, within autoscaling_config's min_replicas and "
                                                    "max_replicas: a replica is added when the p90 stays above "
                                                    "this; None: Serve's policy (on ongoing requests) when "
                                                    "autoscaling_config is given.")
    autoscaling_target_queue: int = Field(4, ge=0, description="With autoscaling_target_ttft_s: a replica is also "
                                          "added when more requests than this wait per replica.")
    autoscaling_upscale_delay_s: float = Field(10.0, ge=0, description="With autoscaling_target_ttft_s: how long "
                                               "the p90 (or the queue) must stay above target before a replica is "
                                               "added.")
    autoscaling_downscale_delay_s: float = Field(60.0, ge=0, description="With autoscaling_target_ttft_s: how long "
                                                 "the p90 must stay under half the target, with nothing waiting, "
                                                 "before a replica is removed (one at a time).")
    autoscaling_ttft_window_s: float = Field(10.0, gt=0, description="With autoscaling_target_ttft_s: each "
                                             "replica's p90 is over the first tokens of this many last seconds.")
    dtype: str = Field("auto", description="Weights' dtype: float32, bfloat16 or float16; auto: float32 on the "
                       "CPU, on CUDA the checkpoint's 16-bit dtype or bfloat16.")
    seed: int = Field(0, description="torch's seed in each engine (sampling of requests that give no `seed`).")
    max_num_seqs: int = engine_arg("max_num_seqs", ge=1)
    max_num_batched_tokens: int = engine_arg("max_num_batched_tokens", ge=1)
    block_size: int = engine_arg("block_size", ge=1)
    gpu_memory_utilization: float = engine_arg("gpu_memory_utilization", gt=0, le=1)
    kv_cache_memory_bytes: int | None = engine_arg("kv_cache_memory_bytes", ge=1)
    kv_cache_bytes: int | None = engine_arg("kv_cache_bytes", ge=1)
    num_kv_blocks: int | None = engine_arg("num_kv_blocks", ge=1)
    kv_cache_dtype: KVCacheDtype = engine_arg("kv_cache_dtype")
    kv_offload_bytes: int = engine_arg("kv_offload_bytes", ge=0)
    kv_offload_dir: str | None = engine_arg("kv_offload_dir")
    kv_share_dir: str | None = engine_arg("kv_share_dir")
    kv_share_bytes: int = engine_arg("kv_share_bytes", ge=0)
    attention_backend: AttentionBackend = engine_arg("attention_backend")
    enforce_eager: bool | None = engine_arg("enforce_eager")
    compile_cache_dir: str | None = engine_arg("compile_cache_dir")
    quantization: Quantization = engine_arg("quantization")
    quantization_group_size: QuantizationGroupSize = engine_arg("quantization_group_size")
    quantization_activations: QuantizationActivations = engine_arg("quantization_activations")
    quantize_lm_head: QuantizeLmHead = engine_arg("quantize_lm_head")
    speculative_config: dict[str, Any] | None = engine_arg("speculative_config")
    lora_modules: dict[str, str] | None = engine_arg("lora_modules")
    lora_dynamic_path: str | None = engine_arg("lora_dynamic_path")
    max_loras: int = engine_arg("max_loras", ge=1)
    max_lora_rank: int = engine_arg("max_lora_rank", ge=1)
    max_model_len: int | None = engine_arg("max_model_len", ge=1)
    # tensor parallelism: the workers of each replica sit in a placement group Serve reserves per
    # replica (service/replica/placement.py)
    tensor_parallel_size: int = engine_arg("tensor_parallel_size", ge=1)
    pipeline_parallel_size: int = engine_arg("pipeline_parallel_size", ge=1)
    tp_worker_num_cpus: float = engine_arg("tp_worker_num_cpus", gt=0)
    placement_group_strategy: PlacementStrategy = Field(
        "PACK", description="How a replica's placement group (bundle 0 the replica, then one per tensor-parallel "
                            "rank) is placed on nodes: PACK, STRICT_PACK (one node), SPREAD, STRICT_SPREAD.")
    enable_prefix_caching: bool = engine_arg("enable_prefix_caching")
    encoder_cache_size: int = engine_arg("encoder_cache_size", ge=0)
    scheduling_policy: SchedulingPolicy = engine_arg("scheduling_policy")
    priority_aging_s: float = engine_arg("priority_aging_s", ge=0)
    lowest_priority_max_seqs: int | None = engine_arg("lowest_priority_max_seqs", ge=0)
    prefix_aware_routing: bool = Field(True, description="With several replicas: a request whose prompt shares a "
                                       "cached prefix (or that names a LoRA adapter) goes to the replica holding "
                                       "it.")
    routing_imbalance_threshold: int = Field(8, ge=0, description="...unless that replica has this many more "
                                             "requests than the least busy one.")
    routing_tier_imbalance_threshold: int = Field(1, ge=0, description="The same allowance when the shared KV tier "
                                                  "(`kv_share_dir`) holds all the replica holds of the prefix: "
                                                  "any replica then loads it instead of recomputing.")
    kv_cache_index: bool = Field(False, description="With prefix-aware routing: the engines publish their KV "
                                 "cache events (blocks stored, evicted) to one index of the app, and the router "
                                 "sends a request to the replica the index says holds the longest run of its "
                                 "prompt, instead of the one it last sent that prefix to.")
    kv_remote_fetch: bool = Field(False, description="With kv_cache_index: a replica whose pool misses a prompt's "
                                  "leading blocks that another replica's pool holds (on any node) takes them from "
                                  "it instead of computing them, when moving them is measured to be faster.")
    kv_remote_fetch_min_tokens: int = Field(256, ge=1, description="Prompts shorter than this are computed, never "
                                            "fetched.")
    kv_remote_fetch_timeout_s: float = Field(5.0, gt=0, description="How long a fetch from another replica may "
                                             "take before the prompt is computed instead.")
    # admission: each engine replica's own gate (service/engine/admission.py)
    max_ongoing_requests: int | None = Field(None, ge=1, description="Requests in flight in one engine replica; "
                                             "None: max_num_seqs plus a quarter of it (at least 4), so nothing "
                                             "caps the batch.")
    max_queued_requests: int = Field(256, ge=-1, description="Requests one replica admits beyond "
                                     "max_ongoing_requests, waiting; past that an immediate overload_status with "
                                     "Retry-After. -1: no limit.")
    overload_status: Literal[503, 429] = Field(503, description="The status of a request turned away because the "
                                               "replica is full.")
    retry_after_s: float = Field(1.0, ge=0, description="The Retry-After of an overloaded answer, in seconds.")
    api_key: str | None = Field(None, description="Requests must send it (`Authorization: Bearer`, or `x-api-key` "
                                "on the Messages routes), else 401; None: the QKV_API_KEY environment variable, "
                                "unset: no key.")
    api_keys_file: str | None = Field(None, description="A keys file (YAML or JSON; a mounted Kubernetes Secret "
                                      "works): tenants, the sha256 of their keys, the models each may use, their "
                                      "requests and tokens per minute, concurrency and default priority "
                                      "(docs: Tenants). Read again when it changes. Replaces api_key.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="The largest request body; 413 past it.")
    max_header_bytes: int = Field(32 * 1024, ge=1024, description="The largest path plus headers; 431 past it.")
    request_timeout_s: float | None = Field(None, gt=0, description="Whole-request deadline: a request still "
                                            "running after it is aborted with a 504; None: none.")
    max_attention_floats: int = Field(1 << 20, ge=1, description="The most attention weights one /v1/attention "
                                      "answer holds (400 past it).")
    # images in chat requests, for vision models (service/http/images.py; docs: Images)
    limit_mm_per_prompt: dict[Literal["image"], int] = Field({"image": 8}, description="The most images one request "
                                                             "may carry, as vLLM names it (`{\"image\": N}`); 400 past "
                                                             "it.")
    max_image_bytes: int = Field(10 << 20, ge=1, description="The largest image, encoded (the file's bytes, not its "
                                 "base64); 400 past it. An image sent inline also needs max_body_bytes above the "
                                 "request's size.")
    max_image_pixels: int = Field(4096 * 4096, ge=1, description="The most pixels (width x height) of one image, read "
                                  "from its header before its pixels are decoded; 400 past it.")
    allowed_local_media_path: str | None = Field(None, description="A directory whose files requests may name as "
                                                 "`file://` image URLs (symlinks and `..` resolved first: nothing "
                                                 "outside it is read); None: `file://` URLs are refused.")
    allowed_media_domains: list[str] | None = Field(None, description="Hosts whose `http(s)://` image URLs the "
                                                    "replicas fetch (exact names; redirects are not followed); None: "
                                                    "image URLs on the web are refused, send data URLs.")
    image_fetch_timeout_s: float = Field(5.0, gt=0, description="The longest fetch of one remote image, start to "
                                         "end; 400 past it.")
    tool_call_parser: Literal["auto", "none", "hermes", "llama3_json", "mistral", "pythonic"] = Field(
        "auto", description="The format tool calls are read in: auto: from the chat template; none: text only.")
    reasoning_parser: Literal["auto", "none", "qwen3", "deepseek_r1"] = Field(
        "auto", description="Whether `<think>` text is split into reasoning_content: auto: for chat templates "
                            "that think; none: never.")
    batch_dir: str | None = Field(None, description="Where OpenAI's Files and Batch APIs (`/v1/files`, "
                                  "`/v1/batches`) keep uploads, batches and their results, which survive a restart: "
                                  "a directory (a path or a file:// URI; a shared mount serves several nodes) or an "
                                  "fsspec URI such as s3://bucket/prefix (its filesystem package installed). The "
                                  "replicas that share it run its batches at the lowest priority beside interactive "
                                  "requests. None: those APIs are not served (404).")
    batch_max_file_bytes: int = Field(200 << 20, ge=1, description="The largest file `/v1/files` accepts; 413 past "
                                      "it.")
    batch_max_lines: int = Field(50_000, ge=1, description="The most requests (non-empty lines) of one batch input "
                                 "file; 413 past it.")
    batch_concurrency: int = Field(4, ge=1, description="Requests of one batch a replica has in flight at once.")
    batch_offline_min_lines: int | None = Field(
        None, ge=1, description="A batch of at least this many requests runs as a Ray Data job on the cluster (engine "
        "actors of its own, each running the replica's HTTP edge, so every line gets the interactive endpoint's "
        "answer) instead of in the replicas' engines; a tenant with quotas is never handed off. None: every batch "
        "runs in the replicas.")
    batch_offline_concurrency: int = Field(1, ge=1, description="Engine actors of one such Ray Data job.")
    batch_offline_num_cpus: float = Field(1.0, ge=0, description="CPUs of each engine actor of a Ray Data batch job.")
    batch_offline_num_gpus: float = Field(0.0, ge=0, description="GPUs of each engine actor of a Ray Data batch job "
                                          "(above 0: its engine runs on CUDA).")
    stream_interval_ms: float = Field(0.0, ge=0, le=1000, description="Each stream writes at most this often, the "
                                      "steps' tokens in between merged into one chunk; 0: as soon as a step "
                                      "delivers, merging only what a slow client left unread.")
    graceful_shutdown_timeout_s: float = Field(300.0, ge=0, description="How long a stopping replica (redeploy, "
                                               "scale-down) lets its requests finish.")
    stall_timeout_s: float = Field(60.0, gt=0, description="How long the engine may go without progress, with work "
                                   "to do, before /health and Serve's health check fail (and Serve replaces the "
                                   "replica).")
    engine_num_cpus: float = Field(1.0, gt=0, description="Ray CPUs of an engine replica: its step and its HTTP "
                                   "edge.")
    router_num_cpus: float = Field(0.25, ge=0, description="Ray CPUs of the prefix router HAProxy asks (only with "
                                   "several replicas and prefix_aware_routing).")
    torch_threads: int | None = Field(None, ge=1, description="torch's intra-op threads in an engine; None: "
                                      "engine_num_cpus' whole CPUs (at least 1) on the CPU, torch's default on a "
                                      "GPU.")
    models: list[dict[str, Any]] | None = Field(None, description="Several base models behind one endpoint: a "
                                                "list of per-model argument dicts, each taking these arguments "
                                                "(service/app/multi.py).")

    @model_validator(mode="after")
    def _one_kind_of_key(self) -> "AppArgs":
        if self.api_keys_file and self.api_key:
            raise ValueError("set api_key or api_keys_file, not both: the keys file names every key")
        if self.api_keys_file and self.models is not None:
            raise ValueError("api_keys_file serves one model per app for now; leave out models, or use api_key")
        if self.api_keys_file:
            KeyTable(self.api_keys_file)  # a missing or invalid file fails here, not in every replica
        if self.kv_cache_index and self.models is not None:
            raise ValueError("kv_cache_index serves one model per app for now; leave out models")
        if self.kv_remote_fetch and not self.kv_cache_index:  # the index says which replica holds a prefix
            raise ValueError("kv_remote_fetch needs kv_cache_index: true")
        if self.batch_dir and self.models is not None:  # any replica may run any batch of the directory
            raise ValueError("batch_dir serves one model per app for now; leave out models")
        if self.batch_offline_min_lines is not None and not self.batch_dir:
            raise ValueError("batch_offline_min_lines needs batch_dir (the Batch API it runs batches of)")
        if self.batch_offline_min_lines is not None and self.tensor_parallel_size > 1:
            raise ValueError("batch_offline_min_lines runs one-device engines; with tensor_parallel_size > 1 leave it "
                             "out")
        return self

    @model_validator(mode="after")
    def _ttft_autoscaling_has_bounds(self) -> "AppArgs":
        if self.autoscaling_target_ttft_s is None or self.models is not None:  # (each entry checks its own)
            return self
        config = self.autoscaling_config or {}
        if "max_replicas" not in config:
            raise ValueError("autoscaling_target_ttft_s needs autoscaling_config with the bounds it scales within, "
                             'e.g. {"min_replicas": 1, "max_replicas": 4}')
        replaced = sorted(REPLACED_SERVE_KEYS & config.keys())
        if replaced:
            raise ValueError(f"autoscaling_config's {', '.join(replaced)} do not apply with autoscaling_target_ttft_s "
                             "(its policy decides, with autoscaling_upscale_delay_s and autoscaling_downscale_delay_s)")
        low, high = config.get("min_replicas", 1), config["max_replicas"]
        if not isinstance(low, int) or low < 1:
            raise ValueError(f"autoscaling_config's min_replicas must be >= 1 with autoscaling_target_ttft_s (the "
                             f"policy reads the replicas' own first-token latencies: one must run), got {low!r}")
        if not isinstance(high, int) or high < low:
            raise ValueError(f"autoscaling_config's max_replicas must be >= min_replicas ({low}), got {high!r}")
        return self

    def scaling_targets(self) -> ScalingTargets:
        """What the TTFT autoscaling policy aims for (needs autoscaling_target_ttft_s)."""
        assert self.autoscaling_target_ttft_s is not None
        return ScalingTargets(target_ttft_s=self.autoscaling_target_ttft_s, max_num_seqs=self.max_num_seqs,
                              target_queue=self.autoscaling_target_queue,
                              upscale_delay_s=self.autoscaling_upscale_delay_s,
                              downscale_delay_s=self.autoscaling_downscale_delay_s)

    @model_validator(mode="after")
    def _prefill_needs_the_prefix_cache(self) -> "AppArgs":
        if self.prefill_replicas:
            for name, ok in (("enable_prefix_caching", self.enable_prefix_caching),
                             ("tensor_parallel_size 1", self.tensor_parallel_size == 1),
                             ("one model (not models)", self.models is None)):
                if not ok:
                    raise ValueError(f"prefill_replicas needs {name}: the engine replicas take the Prefill "
                                     "deployment's blocks into their prefix cache, one process each")
        return self

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _image_limit_counts(cls, value: dict[str, int]) -> dict[str, int]:
        if value.get("image", 0) < 0:
            raise ValueError(f'limit_mm_per_prompt\'s "image" must be >= 0, got {value["image"]}')
        return value

    @field_validator("allowed_local_media_path")
    @classmethod
    def _media_path_is_a_directory(cls, value: str | None) -> str | None:
        if value and not os.path.isdir(value):  # checked here, not in every replica
            raise ValueError(f"allowed_local_media_path must be an existing directory, got {value!r}")
        return value

    @field_validator("batch_dir")
    @classmethod
    def _batch_dir_is_shared_storage(cls, value: str | None) -> str | None:
        """A local path or a `file://` URI, made absolute here (a replica's working directory is
        not the caller's), or an fsspec URI whose filesystem is installed (`s3://` with s3fs...);
        `memory://` is refused: each replica would have its own."""
        if not value:
            return value
        scheme, sep, rest = value.partition("://")
        if not sep or scheme == "file":
            return os.path.abspath(os.path.expanduser(rest if sep else value))
        if scheme == "memory":
            raise ValueError(f"batch_dir {value!r}: memory:// lives in one process, and every replica would have "
                             "its own; give a path, a shared mount or an object store URI")
        check_url(value)
        return value

    @field_validator("pipeline_parallel_size")
    @classmethod
    def _one_pipeline_stage(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"pipeline_parallel_size must be 1, got {value}: pipeline parallelism is not "
                             "implemented; shard a model over several workers with tensor_parallel_size")
        return value

    def engine_config(self) -> dict[str, Any]:
        """The `EngineConfig` fields among these arguments, as keyword arguments."""
        return {name: getattr(self, name) for name in type(self).model_fields if name in _ENGINE_FIELDS}

    def resolved_max_ongoing(self) -> int:
        # The whole batch plus a small waiting line inside the engine, which admits it between steps.
        return self.max_ongoing_requests or self.max_num_seqs + max(4, self.max_num_seqs // 4)

    def admission(self) -> int:
        """Requests one replica admits at once (its engine slots and its queue); -1: no limit."""
        return admission_capacity(self.resolved_max_ongoing(), 1, self.max_queued_requests)

    def max_engine_replicas(self) -> int:
        if self.autoscaling_config:
            return int(self.autoscaling_config.get("max_replicas", 1))
        return self.num_replicas

    def resolved_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if is_preset(self.model) or (is_hub_id(self.model) and not os.path.isdir(self.model)):
            return self.model  # as vLLM names a hub model: "org/name"
        return Path(self.model.rstrip("/")).name


def use_gpu(accelerator: str) -> bool:
    """auto: GPUs if this torch is a CUDA build and the cluster has GPUs (decided here, so a
    replica never waits forever for a GPU that does not exist, and the CPU build's default
    install serves on the CPU of a machine that has GPUs instead of failing there)."""
    if accelerator != "auto":
        return accelerator == "gpu"
    import torch

    if torch.version.cuda is None:  # a CPU build (the Makefile's default pin) cannot use a GPU
        return False
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) >= 1
    return torch.cuda.is_available()
