"""`EngineParts`: what an `Engine` is constructed from (`model.engine.builder` makes them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from model.config import EngineConfig, ModelConfig, RuntimeInfo
from model.engine.embedder import Embedder
from model.engine.kv.offload import KVOffload
from model.engine.kv.share import SharedTier
from model.engine.kv.transfer import IncomingBlocks
from model.engine.lora_manager import LoraManager
from model.engine.scheduler import Scheduler
from model.engine.spec_decode.decoder import SpecDecoder
from model.inspect.attention_spec import AttentionShape
from model.loading.generation_config import GenerationConfig
from model.loading.quant.scheme import QuantScheme
from model.loading.tokenizer import Tokenizer
from model.multimodal.processor import ImageProcessor
from model.sampling.structured import StructuredOutputs


@dataclass
class EngineParts:
    """Everything an `Engine` runs with, made by `model.engine.builder.build_parts`."""

    config: EngineConfig
    model_name: str  # as the caller named it: a preset, a directory or a hub id
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    model_config: ModelConfig
    tokenizer: Tokenizer
    generation_config: GenerationConfig
    runner: Any  # ModelRunner, or TensorParallelRunner (model/engine/parallel/driver.py)
    scheduler: Scheduler
    runtime: RuntimeInfo
    quant_scheme: QuantScheme | None  # on the fly, or the checkpoint's own (GPTQ, AWQ)
    head_scheme: QuantScheme | None  # the LM head's (model/loading/quant/quantize.head_scheme)
    int8_activations: bool
    lora: LoraManager | None
    embedder: Embedder | None  # None under tensor parallelism: embeddings need the whole model here
    attention_shape: AttentionShape
    prefix_salt: bytes  # the router hashes prompts as this engine does (service/routing/router.py)
    kv_namespace: str  # what this engine's blocks are valid for: shared and transferred blocks carry it
    kv_offload: KVOffload | None
    kv_share: SharedTier | None
    incoming: IncomingBlocks | None  # blocks a prefill replica computed for requests not yet admitted
    structured: StructuredOutputs
    image_processor: ImageProcessor | None
    spec: SpecDecoder | None
