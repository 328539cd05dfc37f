"""The engine's runner under tensor parallelism: one Ray actor per rank, the driver holds no weights.

Per step the driver flattens the scheduled batch (`runner.flatten`, as `ModelRunner.prepare` does)
into one `FlatStep`, put once into Ray's object store and passed to every worker; rank 0 answers the
logits rows the step needs (the sampling rows, then prompt-logprob and speculative rows), and
the driver samples. No per-layer traffic goes through Ray: the all-reduces run between the
workers over torch.distributed (gloo on the CPU, NCCL on CUDA).

Nothing waits forever: worker start-up, every step and every health check have a deadline
(`QKV_TP_LOAD_TIMEOUT_S`, default 600; `QKV_TP_TIMEOUT_S`, default 60, also the process group's
collective timeout), and a dead worker or a missed deadline is a `WorkerDiedError`.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import time
import weakref
from dataclasses import dataclass

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from model.config import PRESETS, EngineConfig, ModelConfig
from model.engine.parallel.errors import WorkerDiedError
from model.engine.parallel.sharding import check_shardable
from model.engine.parallel.worker import StepOutput, TensorParallelWorker, WorkerSetup
from model.engine.runner import FlatStep, deliver_logits, extra_logit_spans, flatten
from model.engine.scheduler import ScheduledSeq
from model.engine.sequence import TokenLogprob
from model.loading.checkpoint import load_config
from model.loading.generation_config import GenerationConfig, load_generation_config
from model.loading.tokenizer import Tokenizer, load_tokenizer
from model.sampling.sampler import SamplingRow, sample

logger = logging.getLogger(__name__)


def _timeout(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@dataclass
class ParallelStats:
    """Totals since start, over steps: the workers' communication time (rank 0's seconds inside
    all-reduce/gather), their step time, and the Ray round trip beyond the slowest worker's step."""

    steps: int = 0
    comm_seconds: float = 0.0
    worker_seconds: float = 0.0
    round_trip_seconds: float = 0.0
    collectives: int = 0


class TensorParallelRunner:
    """`ModelRunner`'s `run` contract over `engine_config.tensor_parallel_size` worker actors.

    Inside a Ray placement group (a Serve replica's), worker i takes bundle i + 1 (bundle 0 is the
    replica); otherwise Ray places them. Without a running Ray, a local one is started (and shut
    down with the runner)."""

    model = None  # no weights in the driver

    def __init__(self, source: str, cfg: ModelConfig, ec: EngineConfig, num_blocks: int, device: torch.device,
                 dtype: torch.dtype, kv_cache_dtype: torch.dtype, requested_device: str = "auto") -> None:
        """`device`: where the driver samples; the workers run on CUDA (NCCL, one GPU each) when it is
        CUDA, or when `requested_device` is "auto" and the Ray cluster has a GPU per rank (a Serve
        replica in bundle 0 of its placement group holds no GPU itself); otherwise on the CPU (gloo)."""
        world = ec.tensor_parallel_size
        check_shardable(cfg, world)
        self.device, self.world, self.block_size = device, world, ec.block_size
        self.stats = ParallelStats()
        self.timeout_s = _timeout("QKV_TP_TIMEOUT_S", 60)
        self._owns_ray = False
        self._workers: list = []
        if not ray.is_initialized():
            ray.init(address="local", num_cpus=max(1, math.ceil(world * ec.tp_worker_num_cpus)),
                     include_dashboard=False, _node_ip_address="127.0.0.1")
            self._owns_ray = True
        cuda = device.type == "cuda" or (requested_device == "auto"
                                         and ray.cluster_resources().get("GPU", 0) >= world)
        actor = ray.remote(TensorParallelWorker)
        group = ray.util.get_current_placement_group()
        for rank in range(world):
            options = {"num_cpus": 0 if cuda else ec.tp_worker_num_cpus, "num_gpus": 1 if cuda else 0,
                       "max_concurrency": 2}  # a health check answers while a step runs
            if group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank + 1)
            self._workers.append(actor.options(**options).remote(rank, world, max(1, int(ec.tp_worker_num_cpus))))
        atexit.register(_shutdown_ref, weakref.ref(self))
        setup = WorkerSetup(source, cfg, num_blocks, ec.block_size, str(dtype).removeprefix("torch."),
                            str(kv_cache_dtype).removeprefix("torch."), ec.attention_backend,
                            "cuda" if cuda else "cpu", self.timeout_s)
        load_timeout = _timeout("QKV_TP_LOAD_TIMEOUT_S", 600)
        try:
            host, port = self._wait([self._workers[0].address.remote()], load_timeout, "starting")[0]
            sizes = self._wait([w.init.remote(host, port, setup) for w in self._workers], load_timeout, "loading")
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel over %d workers (%s, rendezvous %s:%d), %.1f MiB of weights per rank",
                    world, "nccl" if cuda else "gloo", host, port, max(sizes) / 2**20)

    @property
    def workers(self) -> list:
        """The worker actor handles, rank order."""
        return list(self._workers)

    def _wait(self, refs: list, timeout: float, what: str) -> list:
        """Every result of `refs`; WorkerDiedError as soon as one fails, or when `timeout` passes."""
        deadline, pending = time.monotonic() + timeout, list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise WorkerDiedError(f"tensor-parallel workers did not finish {what} within {timeout:.0f} s "
                                      "(a worker died or a collective hangs)")
            try:
                ray.get(ready[0])
            except (ray.exceptions.RayError, OSError) as exc:
                raise WorkerDiedError(f"a tensor-parallel worker failed while {what}: {exc}") from exc
        return ray.get(refs)

    def check_health(self) -> None:
        """WorkerDiedError when a worker is dead (or shut down, or does not answer in time)."""
        if not self._workers:
            raise WorkerDiedError("the tensor-parallel workers are shut down")
        self._wait([w.ping.remote() for w in self._workers], min(self.timeout_s, 10.0), "answering a health check")

    def shutdown(self) -> None:
        """Kill the workers (and the local Ray this runner started); safe to call more than once."""
        workers, self._workers = self._workers, []
        for w in workers:
            try:
                ray.kill(w)
            except Exception:  # already dead, or Ray is gone
                pass
        if self._owns_ray and ray.is_initialized():
            self._owns_ray = False
            ray.shutdown()

    # ---- the step -----------------------------------------------------------------

    def run(self, batch: list[ScheduledSeq], rows: list[SamplingRow],
            prompt_logprobs: dict[str, list[TokenLogprob]] | None = None,
            spec_logits: dict[str, torch.Tensor] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
        """As `ModelRunner.run`; raises WorkerDiedError when a worker dies or the step times out."""
        if not self._workers:
            raise WorkerDiedError("the tensor-parallel workers are shut down")
        msg, sample_idx, extra = self._prepare(batch, prompt_logprobs, spec_logits)
        start = time.perf_counter()
        ref = ray.put(msg)
        outs: list[StepOutput] = self._wait([w.step.remote(ref) for w in self._workers], self.timeout_s, "a step")
        self._account(outs, time.perf_counter() - start)
        logits = outs[0].logits
        if logits is None:
            return [], []
        logits = logits.to(self.device)
        for seq, kind, first, n in extra:
            deliver_logits(seq, kind, logits[first:first + n], prompt_logprobs, spec_logits)
        if not sample_idx:
            return [], []
        return sample(logits[: len(sample_idx)], rows)

    def _account(self, outs: list[StepOutput], wall: float) -> None:
        s = self.stats
        s.steps += 1
        s.comm_seconds += outs[0].comm_seconds
        s.collectives += outs[0].num_collectives
        slowest = max(o.step_seconds for o in outs)
        s.worker_seconds += slowest
        s.round_trip_seconds += max(0.0, wall - slowest)

    def _prepare(self, batch: list[ScheduledSeq], prompt_logprobs: dict | None, spec_logits: dict | None
                 ) -> tuple[FlatStep, list[int], list[tuple]]:
        """The step's message (`flatten`'s, as the single-device runner builds it), the flat rows
        that sample (in `batch` order), and the extra logits rows asked for (`extra_logit_spans`,
        with the first row of each in the answer instead of the flat one)."""
        msg, spans, sample_idx = flatten(batch, self.block_size)
        msg.logit_rows = list(sample_idx)
        extra = []
        for seq, kind, first, n in extra_logit_spans(spans, prompt_logprobs, spec_logits):
            extra.append((seq, kind, len(msg.logit_rows), n))
            msg.logit_rows.extend(range(first, first + n))
        return msg, sample_idx, extra


def model_metadata(source: str) -> tuple[ModelConfig, Tokenizer, GenerationConfig]:
    """A preset's or checkpoint directory's config, tokenizer and generation config, without its
    weights (the driver of a tensor-parallel engine holds none)."""
    if source in PRESETS:
        cfg = PRESETS[source]
        return cfg, load_tokenizer(None, cfg.vocab_size), GenerationConfig()
    cfg = load_config(source)
    return cfg, load_tokenizer(source, cfg.vocab_size), load_generation_config(source)


def _shutdown_ref(ref: weakref.ref) -> None:
    runner = ref()
    if runner is not None:
        runner.shutdown()
