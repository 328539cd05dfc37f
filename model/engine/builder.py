"""The engine's builder: `EngineConfig` and a model source -> the parts an `Engine` runs with.

`build_engine` resolves the model, loads (and quantizes) its weights, sizes the paged KV cache,
and makes the runner, the KV tiers, the scheduler, the LoRA manager, the speculative decoder and
the per-request helpers; `Engine(parts)` only keeps them. Start-up work (sizing memory, timing
phases) belongs here, never in the step.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from model.config import PRESETS, EngineConfig, ModelConfig, RuntimeInfo, SpeculativeConfig
from model.engine.embedder import Embedder
from model.engine.engine import Engine
from model.engine.host_memory import keep_freed_memory
from model.engine.kv.block_manager import BlockManager, blocks_for
from model.engine.kv.events import KVEventLog
from model.engine.kv.offload import KVOffload, PoolBlocks
from model.engine.kv.share import SharedTier, Tiers
from model.engine.kv.share_layout import namespace
from model.engine.kv.transfer import IncomingBlocks
from model.engine.lora_manager import LoraManager
from model.engine.memory import (MemoryPlan, check_fits, cpu_kv_cache_bytes, describe, device_memory, gpu_kv_budget,
                                 module_bytes, plan_blocks)
from model.engine.parts import EngineParts
from model.engine.runner import ModelRunner
from model.engine.scheduler import Scheduler
from model.engine.spec_decode.decoder import SpecDecoder
from model.engine.spec_decode.draft import DraftProposer
from model.inspect.attention_spec import AttentionShape
from model.layers.kv_cache import KVCache
from model.layers.linear.fuse import fuse_projections
from model.loading.checkpoint import load_config
from model.loading.loading import is_preset, load_weights, model_dtype, resolve_device, resolve_dtype, resolve_model
from model.loading.pooling_config import read_pooling_config
from model.loading.quant.quantize import head_scheme, on_the_fly_scheme, quantization_of, set_int8_activations
from model.loading.quant.scheme import QuantScheme
from model.multimodal.processor import ImageProcessor
from model.sampling.structured import StructuredOutputs

logger = logging.getLogger(__name__)


def build_engine(model: str = "transformer-base", engine_config: EngineConfig | None = None, device: str = "auto",
                 dtype: str = "auto", seed: int = 0, revision: str | None = None) -> Engine:
    """An engine hosting `model`: a preset, a checkpoint directory or an HF hub id (at `revision`)."""
    return Engine(build_parts(model, engine_config, device, dtype, seed, revision))


def build_parts(model: str, engine_config: EngineConfig | None = None, device: str = "auto", dtype: str = "auto",
                seed: int = 0, revision: str | None = None) -> EngineParts:
    ec = engine_config or EngineConfig()
    dev = resolve_device(device)
    use_compile_cache(ec.compile_cache_dir)
    phases: dict[str, float] = {}
    started = time.perf_counter()
    source = resolve_model(model, revision)  # a preset, or the checkpoint directory (a hub id's snapshot)
    dt = resolve_dtype(dtype, dev, model_dtype(source))
    torch.manual_seed(seed)
    head: QuantScheme | None = None
    if ec.tensor_parallel_size > 1:  # the weights live in the workers (model/engine/parallel/)
        from model.engine.parallel.driver import model_metadata  # noqa: PLC0415 (imports Ray)

        cfg, tokenizer, generation_config = model_metadata(source)
        net = None
    else:
        layers = on_the_fly_scheme(ec.quantization, ec.quantization_group_size)
        head = head_scheme(ec.quantize_lm_head, layers, dev)
        cfg, net, tokenizer, generation_config = load_weights(source, dt, dev, quantize=layers,
                                                              quantize_lm_head=head or False)
        fuse_projections(net)  # q/k/v and gate/up as one product each (model/layers/linear/fuse.py)
    phases["load"] = time.perf_counter() - started
    quant = quantization_of(net)
    max_len, kv_dtype = model_len(ec, cfg), cache_dtype(ec, dt)
    plan = memory_plan(ec, cfg, net, max_len, kv_dtype, dev, phases)
    num_blocks = plan.num_blocks
    refuse_unfit(plan, ec, cfg, max_len)
    logger.info("memory: %s", describe(plan, ec.block_size, max_len))
    allocated = time.perf_counter()
    # One block more than the block manager hands out: the scratch block where padding rows of
    # static (CUDA-graph) decode batches write (model/engine/runner.py).
    if net is None:
        from model.engine.parallel.driver import TensorParallelRunner  # noqa: PLC0415

        runner = TensorParallelRunner(source, cfg, ec, num_blocks + 1, dev, dt, kv_dtype, requested_device=device)
        pool: list[torch.Tensor] = []
    else:
        cache = KVCache(cfg.n_layers, num_blocks + 1, ec.block_size, cfg.kv_heads, cfg.d_head, kv_dtype, dev)
        runner = ModelRunner(net, cache, dev, ec.attention_backend, ec.enforce_eager, scratch_block=num_blocks,
                             max_num_seqs=ec.max_num_seqs, max_model_len=max_len,
                             encoder_cache_size=ec.encoder_cache_size)
        pool = cache.keys + cache.values
    phases["kv_cache"] = time.perf_counter() - allocated
    if dev.type == "cpu":  # after the load, whose temporaries went back to the kernel
        keep_freed_memory()  # steps reuse the pages the last one freed (model/engine/host_memory.py)
    checkpoint = None if source in PRESETS else source
    lora = None
    if ec.lora_modules or ec.lora_dynamic_path:
        lora = LoraManager(net, checkpoint, model, ec.lora_modules, ec.lora_dynamic_path, ec.max_loras,
                           ec.max_lora_rank, dt)
        runner.lora = lora.state
    # One engine hosts one model: its identity (weights seed/architecture, attention kind, dtype)
    # salts every block hash, since the cached K/V are a function of all of them.
    salt = f"{model}|{cfg!r}|{dt}".encode()
    kv_namespace = namespace(salt, [(tuple(t.shape[1:]), str(t.dtype)) for t in pool])
    caching = ec.enable_prefix_caching and ec.enable_kv_cache
    events = KVEventLog() if ec.enable_kv_cache_events and caching else None
    offload = (KVOffload(pool, ec.kv_offload_bytes, ec.kv_offload_dir, events, ec.block_size)
               if ec.kv_offload_bytes and pool else None)
    share = (SharedTier(pool, ec.kv_share_dir, ec.kv_share_bytes, kv_namespace)
             if ec.kv_share_dir is not None and pool else None)
    incoming = IncomingBlocks(PoolBlocks(pool)) if caching and pool else None
    tiers = [t for t in (incoming, offload, share) if t is not None]
    blocks = BlockManager(num_blocks, ec.block_size, enable_prefix_caching=caching, salt=salt,
                          tier=tiers[0] if len(tiers) == 1 else Tiers(*tiers) if tiers else None,
                          events=events)
    eos = frozenset(tokenizer.eos_token_ids)
    parts = EngineParts(
        config=ec, model_name=model, device=dev, dtype=dt, kv_cache_dtype=kv_dtype, model_config=cfg,
        tokenizer=tokenizer, generation_config=generation_config, runner=runner,
        scheduler=scheduler_for(ec, cfg, blocks),
        runtime=RuntimeInfo(str(dev), str(dt).removeprefix("torch."), num_blocks, ec.block_size, max_len,
                            quant.method if quant else "none", kv_cache_bytes=plan.kv_cache_bytes,
                            weights_bytes=plan.weights_bytes, activation_peak_bytes=plan.activation_peak_bytes,
                            startup_seconds=phases),
        quant_scheme=quant, head_scheme=head,
        int8_activations=net is not None and int8_activations(net, quant, dev, ec.quantization_activations),
        lora=lora,
        embedder=(Embedder(net, read_pooling_config(checkpoint, cfg.d_model), dev, ec.max_num_batched_tokens)
                  if net is not None else None),
        attention_shape=AttentionShape.of(cfg), prefix_salt=salt, kv_namespace=kv_namespace,
        kv_offload=offload, kv_share=share, incoming=incoming,
        structured=StructuredOutputs(tokenizer, cfg.vocab_size, list(tokenizer.eos_token_ids)),
        image_processor=image_processor(cfg, source, net is not None),
        spec=spec_decoder(ec.speculative_config, cfg.vocab_size, eos, num_blocks, ec.block_size, dev, dt,
                          ec.attention_backend),
    )
    graphs = getattr(runner, "graphs", None)
    if graphs is not None and graphs.compiled is not None:  # after every switch the step's layers read (int8 activations)
        compiling = time.perf_counter()
        graphs.warm_up()
        phases["compile"] = time.perf_counter() - compiling
    return parts


def memory_plan(ec: EngineConfig, cfg: ModelConfig, net: torch.nn.Module | None, max_len: int,
                kv_dtype: torch.dtype, device: torch.device, phases: dict[str, float]) -> MemoryPlan:
    """How many KV blocks the cache gets (model/engine/memory.py): `num_kv_blocks`; else
    `kv_cache_memory_bytes`; else on CUDA what `gpu_memory_utilization` leaves after the weights
    and the profiling run's peak (timed as the `profile` phase); else the CPU's default bytes.
    Never more than every sequence slot at full length needs."""
    per_block = KVCache.bytes_per_block(cfg.n_layers, ec.block_size, cfg.kv_heads, cfg.d_head, kv_dtype)
    enough = ec.max_num_seqs * blocks_for(max_len, ec.block_size)
    weights = module_bytes(net) if net is not None else 0  # tensor parallelism: the workers hold them
    if ec.num_kv_blocks is not None:
        return MemoryPlan(ec.num_kv_blocks, per_block, "num_kv_blocks", weights)
    if ec.kv_cache_memory_bytes is not None:
        blocks = plan_blocks(ec.kv_cache_memory_bytes, per_block, enough, "kv_cache_memory_bytes")
        return MemoryPlan(blocks, per_block, "kv_cache_memory_bytes", weights)
    memory = device_memory(device)
    if memory is None:
        blocks = plan_blocks(cpu_kv_cache_bytes(), per_block, enough, "the CPU's default KV cache size")
        return MemoryPlan(blocks, per_block, "cpu_default", weights)
    peak = 0
    if net is not None:
        from model.engine.profile_run import activation_peak  # noqa: PLC0415 (the runner, only here)

        started = time.perf_counter()
        peak = activation_peak(net, cfg, ec, max_len, kv_dtype, device, memory)
        phases["profile"] = time.perf_counter() - started
        budget = gpu_kv_budget(memory.total(), ec.gpu_memory_utilization, weights, peak, memory.free())
    else:  # the driver of tensor-parallel workers: the share of its device not in use yet
        budget = gpu_kv_budget(memory.total(), ec.gpu_memory_utilization, memory.total() - memory.free(), 0)
    blocks = plan_blocks(budget, per_block, enough, f"gpu_memory_utilization={ec.gpu_memory_utilization}")
    return MemoryPlan(blocks, per_block, "gpu_memory_utilization", weights, peak, memory.total())


def check_sizing(model: str, ec: EngineConfig, device: str = "cpu", dtype: str = "auto",
                 revision: str | None = None) -> None:
    """The refusal `build_parts` would make of `max_model_len` or of the KV cache's size, decided
    from the model's config alone where it can be (no weights loaded): a local model whose cache
    is sized in bytes (`kv_cache_memory_bytes`, or the CPU's default). The app builder calls it so
    `serve run` stops at once with the reason instead of in every replica. Where the size needs
    the device (CUDA's profiling run) or a hub download, the replica decides."""
    if ec.num_kv_blocks is not None or ec.tensor_parallel_size > 1:
        return
    dev = torch.device(device)
    if (dev.type == "cuda" and ec.kv_cache_memory_bytes is None) or not (model in PRESETS or os.path.isdir(model)
                                                                        or is_preset(model)):
        return
    source = resolve_model(model, revision)
    cfg = PRESETS[source] if source in PRESETS else load_config(source)
    dt = resolve_dtype(dtype, dev, model_dtype(source))
    max_len = model_len(ec, cfg)
    plan = memory_plan(ec, cfg, None, max_len, cache_dtype(ec, dt), torch.device("cpu"), {})
    refuse_unfit(plan, ec, cfg, max_len)


def model_len(ec: EngineConfig, cfg: ModelConfig) -> int:
    """The engine's max_model_len: the one asked for, never past the model's own."""
    return min(ec.max_model_len or cfg.max_position, cfg.max_position)


def cache_dtype(ec: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: `kv_cache_dtype`, or the weights' for auto."""
    return dtype if ec.kv_cache_dtype == "auto" else getattr(torch, ec.kv_cache_dtype)


def refuse_unfit(plan: MemoryPlan, ec: EngineConfig, cfg: ModelConfig, max_len: int) -> None:
    """`check_fits`'s ValueError when one max_len sequence cannot fit the planned cache; only a
    warning for `num_kv_blocks` (an override, as vLLM's num_gpu_blocks_override: a request too long
    for the pool still gets its 400)."""
    try:
        check_fits(plan.num_blocks, ec.block_size, max_len, widest_window(cfg), plan)
    except ValueError as e:
        if plan.source != "num_kv_blocks":
            raise
        logger.warning("%s (num_kv_blocks is an override: the engine starts anyway)", e)


def use_compile_cache(directory: str | None) -> Path:
    """Point torch.compile's Inductor cache at `directory` (default: under the user's cache dir),
    so every engine process and replica on the machine reuses what one compiled. An explicit
    directory wins over TORCHINDUCTOR_CACHE_DIR; the default does not."""
    if directory is None:
        default = Path.home() / ".cache" / "qkv-serve" / "compile"
        path = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default)))
    else:
        path = Path(directory).expanduser()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compile_cache_dir {str(path)!r} cannot be created: {e}") from None
    return path


def scheduler_for(ec: EngineConfig, cfg: ModelConfig, blocks: BlockManager) -> Scheduler:
    # Rotations that depend on a sequence's length (model/layers/positions.py): dynamic NTK, LongRoPE.
    rope = cfg.rope_scaling if cfg.rope_scaling is not None and cfg.rope_scaling.kind in ("dynamic", "longrope") \
        else None
    return Scheduler(blocks, ec.max_num_seqs, ec.max_num_batched_tokens, recompute_all=not ec.enable_kv_cache,
                     rope_long_from=rope.original_max_position if rope else None,
                     rope_recompute=rope is not None and rope.recompute_past_original,
                     rope_per_length=rope is not None and rope.kind == "dynamic",
                     window=widest_window(cfg), policy=ec.scheduling_policy, priority_aging_s=ec.priority_aging_s,
                     lowest_priority_max_seqs=ec.lowest_priority_max_seqs)


def int8_activations(net: torch.nn.Module, quant: QuantScheme | None, device: torch.device, mode: str) -> bool:
    """Apply `quantization_activations` to the model's quantized layers (CPU only); whether they
    round their activations to int8."""
    from model.layers.linear.kernel import int8_path  # noqa: PLC0415 (builds the kernel)

    if quant is None or device.type != "cpu" or mode == "float32":
        return False
    if int8_path() == 0:
        if mode == "int8":
            logger.warning("quantization_activations=int8: the quantized-matmul kernel has no integer "
                           "vector path on this CPU, keeping float32 activations")
        return False
    return set_int8_activations(net, True) > 0


def image_processor(cfg: ModelConfig, source: str, local: bool) -> ImageProcessor | None:
    """A vision model's image processor (its checkpoint's own); None for a text model."""
    if cfg.vision is None:
        return None
    if not local:
        raise ValueError("vision models do not run with tensor_parallel_size > 1 yet")
    return ImageProcessor.from_directory(source, cfg.vision)


def spec_decoder(raw: dict | None, vocab: int, eos: frozenset[int], num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, backend: str) -> SpecDecoder | None:
    config = SpeculativeConfig.parse(raw)
    if config is None:
        return None
    draft = None
    if config.method == "draft_model":
        draft = DraftProposer(config.model, vocab, eos, num_blocks, block_size, device, dtype, backend)
    return SpecDecoder(config, draft)


def widest_window(cfg: ModelConfig) -> int | None:
    """The sliding window past which a sequence's blocks can be given back: the widest of the
    layers' windows when every layer has one (Mistral v0.1), else None (a global layer reads
    every block, as Gemma 2/3's and gpt-oss's do)."""
    windows = [cfg.layer_window(i) for i in range(cfg.n_layers)]
    return None if any(w is None for w in windows) else max(windows)
