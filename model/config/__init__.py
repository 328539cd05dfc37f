"""Configuration: frozen dataclasses and the named presets, below every other part of `model`.

`model.py` holds the model's shape (`ModelConfig`, its parts, the presets), `speculative.py` the
speculative-decoding argument, `engine.py` the engine's (`EngineConfig`) and what start-up found
(`RuntimeInfo`): values discovered at run time are never patched into a config. Special tokens
(EOS, BOS) are the tokenizer's (`model.loading.tokenizer`), the one place they come from.
"""

from model.config.engine import EngineConfig, RuntimeInfo, max_concurrency
from model.config.fields import REQUIRED, described
from model.config.model import (ATTENTION_BACKENDS, BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB, BYTE_VOCAB_SIZE,
                                KV_CACHE_DTYPES, PRESETS, QUANTIZATION_ACTIVATIONS, QUANTIZATION_GROUP_SIZES,
                                QUANTIZATIONS, QUANTIZE_LM_HEAD, ROPE_SCALING_TYPES, SCHEDULING_POLICIES, Arch,
                                AttentionBackend, AttentionKind, GemmaOptions, KVCacheDtype, ModelConfig, MoEActivation,
                                MoEConfig, MoERouting, Quantization, QuantizationActivations, QuantizationGroupSize,
                                QuantizeLmHead, RopeScaling, SchedulingPolicy, VisionConfig)
from model.config.speculative import SpeculativeConfig

__all__ = [
    "ATTENTION_BACKENDS", "BYTE_EOS_ID", "BYTE_PAD_ID", "BYTE_VOCAB", "BYTE_VOCAB_SIZE", "KV_CACHE_DTYPES", "PRESETS",
    "QUANTIZATION_ACTIVATIONS", "QUANTIZATION_GROUP_SIZES", "QUANTIZATIONS", "QUANTIZE_LM_HEAD", "REQUIRED",
    "ROPE_SCALING_TYPES", "SCHEDULING_POLICIES", "Arch", "AttentionBackend", "AttentionKind", "EngineConfig",
    "GemmaOptions", "KVCacheDtype", "MoEActivation", "MoEConfig", "MoERouting", "ModelConfig", "Quantization",
    "QuantizationActivations", "QuantizationGroupSize", "QuantizeLmHead", "RopeScaling", "RuntimeInfo", "SchedulingPolicy",
    "SpeculativeConfig", "VisionConfig", "described", "max_concurrency",
]
