"""One tensor-parallel rank: a Ray actor holding its shard of the model and a KV cache of its heads.

The driver (`driver.py`) sends every rank the same `FlatStep` (runner.py) per step; each rank runs the forward
pass (its all-reduces meet the other ranks' inside it) and, when rows of logits are asked for,
its vocabulary slice of them, gathered at rank 0, which returns them in its `StepOutput`.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.config import ModelConfig
from model.engine.host_memory import keep_freed_memory
from model.engine.parallel.sharding import Collectives, build_shard, kv_heads_of
from model.engine.runner import FlatStep, ModelRunner
from model.layers.kv_cache import KVCache
from model.layers.linear.fuse import fuse_projections

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """Rank 0's answer: the logits (len(logit_rows), vocab) on the CPU, float32 or the model's dtype;
    other ranks answer logits None. Times in seconds, measured inside the worker."""

    logits: torch.Tensor | None
    step_seconds: float
    comm_seconds: float  # inside all-reduce / gather
    num_collectives: int


@dataclass(frozen=True)
class WorkerSetup:
    """What every rank needs to build its shard (the same for all ranks)."""

    source: str  # a random preset's name or a checkpoint directory
    cfg: ModelConfig
    num_blocks: int  # KV blocks, the scratch block included
    block_size: int
    dtype: str
    kv_cache_dtype: str
    attention_backend: str
    device_type: str  # "cpu" or "cuda"
    timeout_s: float


def free_port(host: str) -> int:
    """A TCP port nobody listens on at `host` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TensorParallelWorker:
    """Rank `rank` of `world`; wrapped in `ray.remote` by the driver. Sets torch's threads to `num_threads`."""

    def __init__(self, rank: int, world: int, num_threads: int) -> None:
        self.rank, self.world = rank, world
        torch.set_num_threads(max(1, num_threads))
        self.comm = Collectives(rank, world)
        self.model = None
        self.vocab = 0

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port on it: the process group's rendezvous (asked of rank 0)."""
        import ray

        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def init(self, host: str, port: int, setup: WorkerSetup) -> int:
        """Join the process group, build this rank's shard and KV cache; returns the shard's bytes."""
        backend = "nccl" if setup.device_type == "cuda" else "gloo"
        if setup.device_type == "cuda":  # Ray shows each worker its one GPU as cuda:0
            torch.cuda.set_device(0)
        device = torch.device(setup.device_type, 0) if setup.device_type == "cuda" else torch.device("cpu")
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=setup.timeout_s))
        cfg = setup.cfg
        dtype = getattr(torch, setup.dtype)
        self.model = build_shard(setup.source, cfg, self.world, self.rank, self.comm, dtype, device)
        fuse_projections(self.model)  # this rank's q/k/v and gate/up shards, one product each
        _, kv = kv_heads_of(cfg, self.world, self.rank)
        cache = KVCache(cfg.n_layers, setup.num_blocks, setup.block_size, kv, cfg.d_head,
                        getattr(torch, setup.kv_cache_dtype), device)
        # The single-device runner picks and holds the attention kernels; its static decode path is off.
        self.runner = ModelRunner(self.model, cache, device, setup.attention_backend, enforce_eager=True)
        self.device, self.vocab = device, cfg.vocab_size
        if device.type == "cpu":
            keep_freed_memory()  # steps reuse the pages the last one freed (model/engine/host_memory.py)
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def ping(self) -> int:
        """A health check's answer: this worker's process id."""
        return os.getpid()

    @torch.inference_mode()
    def step(self, msg: FlatStep) -> StepOutput:
        start = time.perf_counter()
        self.comm.reset()
        tokens, positions, meta = msg.tensors(self.device)
        self.runner.set_kernels(meta)
        hidden = self.model(tokens, positions, meta, self.runner.cache)  # (T, d_model)
        logits = None
        if msg.logit_rows:
            local = self.model.compute_logits(hidden[msg.logit_rows])  # (N, vocab / world)
            logits = self.comm.gather_logits(local, self.vocab)
            if logits is not None:
                logits = logits.cpu()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return StepOutput(logits, time.perf_counter() - start, self.comm.seconds, self.comm.calls)
