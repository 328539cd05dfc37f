"""The engine's builder: `EngineConfig` and a model source -> the parts an `Engine` runs with.

`build_engine` resolves the model, loads (and quantizes) its weights, sizes the paged KV cache,
and makes the runner, the KV tiers, the scheduler, the LoRA manager, the speculative decoder and
the per-request helpers; `Engine(parts)` only keeps them. Start-up work (sizing memory, timing
phases) belongs here, never in the step.
"""

from __future__ import annotations

import logging

import torch

from model.config import PRESETS, EngineConfig, ModelConfig, RuntimeInfo, SpeculativeConfig
from model.engine.embedder import Embedder
from model.engine.engine import Engine
from model.engine.host_memory import keep_freed_memory
from model.engine.kv.block_manager import BlockManager, blocks_for
from model.engine.kv.offload import KVOffload, PoolBlocks
from model.engine.kv.share import SharedTier, Tiers
from model.engine.kv.share_layout import namespace
from model.engine.kv.transfer import IncomingBlocks
from model.engine.lora_manager import LoraManager
from model.engine.parts import EngineParts
from model.engine.runner import ModelRunner
from model.engine.scheduler import Scheduler
from model.engine.spec_decode.decoder import SpecDecoder
from model.engine.spec_decode.draft import DraftProposer
from model.inspect.attention_spec import AttentionShape
from model.layers.kv_cache import KVCache
from model.loading.loading import load_weights, model_dtype, resolve_device, resolve_dtype, resolve_model
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
    quant = quantization_of(net)
    max_len = min(ec.max_model_len or cfg.max_position, cfg.max_position)
    kv_dtype = dt if ec.kv_cache_dtype == "auto" else getattr(torch, ec.kv_cache_dtype)
    num_blocks = kv_blocks(ec, cfg, max_len, kv_dtype, dev)
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
    offload = KVOffload(pool, ec.kv_offload_bytes, ec.kv_offload_dir) if ec.kv_offload_bytes and pool else None
    share = (SharedTier(pool, ec.kv_share_dir, ec.kv_share_bytes, kv_namespace)
             if ec.kv_share_dir is not None and pool else None)
    incoming = IncomingBlocks(PoolBlocks(pool)) if caching and pool else None
    tiers = [t for t in (incoming, offload, share) if t is not None]
    blocks = BlockManager(num_blocks, ec.block_size, enable_prefix_caching=caching, salt=salt,
                          tier=tiers[0] if len(tiers) == 1 else Tiers(*tiers) if tiers else None)
    eos = frozenset(tokenizer.eos_token_ids)
    return EngineParts(
        config=ec, model_name=model, device=dev, dtype=dt, kv_cache_dtype=kv_dtype, model_config=cfg,
        tokenizer=tokenizer, generation_config=generation_config, runner=runner,
        scheduler=scheduler_for(ec, cfg, blocks),
        runtime=RuntimeInfo(str(dev), str(dt).removeprefix("torch."), num_blocks, ec.block_size, max_len,
                            quant.method if quant else "none"),
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


def kv_blocks(ec: EngineConfig, cfg: ModelConfig, max_len: int, kv_dtype: torch.dtype, device: torch.device) -> int:
    """How many KV blocks the cache gets: `num_kv_blocks`, else what the byte budget holds, never
    more than every sequence slot at full length needs."""
    if ec.num_kv_blocks is not None:
        return ec.num_kv_blocks
    per_block = KVCache.bytes_per_block(cfg.n_layers, ec.block_size, cfg.kv_heads, cfg.d_head, kv_dtype)
    budget = ec.kv_cache_bytes
    if budget is None:
        budget = int(ec.kv_cache_fraction * free_memory(device))
    enough = ec.max_num_seqs * blocks_for(max_len, ec.block_size)
    num = min(budget // per_block, enough)
    if num < 1:
        raise ValueError(f"KV cache budget of {budget} bytes is smaller than one block ({per_block} bytes)")
    return int(num)


def scheduler_for(ec: EngineConfig, cfg: ModelConfig, blocks: BlockManager) -> Scheduler:
    # Rotations that depend on a sequence's length (model/layers/positions.py): dynamic NTK, LongRoPE.
    rope = cfg.rope_scaling if cfg.rope_scaling is not None and cfg.rope_scaling.kind in ("dynamic", "longrope") \
        else None
    return Scheduler(blocks, ec.max_num_seqs, ec.max_num_batched_tokens, recompute_all=not ec.enable_kv_cache,
                     rope_long_from=rope.original_max_position if rope else None,
                     rope_recompute=rope is not None and rope.recompute_past_original,
                     rope_per_length=rope is not None and rope.kind == "dynamic",
                     window=widest_window(cfg), policy=ec.scheduling_policy, priority_aging_s=ec.priority_aging_s)


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


def free_memory(device: torch.device) -> int:
    """Bytes of memory free for the KV cache on `device`."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024
