"""qkv-serve's model package: the Transformer, its KV cache and the continuous-batching engine.
One part per sub-package, each importing only the parts below it (tests/test_layering.py holds
the table), from the bottom: `config` (model, engine and speculative configs, presets),
`sampling` (SamplingParams, the sampler, structured outputs, request checks), `layers` (attention
over the paged KV cache and its backends, positions, norms, MLPs, quantized linears), `models`
(the registry and one module per architecture family), `multimodal` and `inspect` (attention
maps), `loading` (files to weights: checkpoints, hub, tokenizers, quantized formats), `engine`
(engine, scheduler, runner, the KV tiers in `engine.kv`, speculative decoding, tensor
parallelism), `training`, and `llm` (the offline API) on top; `weights` holds the trained default.
Names are imported lazily so that the torch-free modules (`engine.sequence`,
`engine.kv.block_manager`, `engine.scheduler`, `sampling.params`, `sampling.request_checks`,
`inspect.attention_spec`) can be used without importing torch (tests/test_layering.py).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "model.llm",
    "CompletionOutput": "model.llm",
    "SamplingParams": "model.sampling.params",
    "ModelConfig": "model.config",
    "EngineConfig": "model.config",
    "PRESETS": "model.config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
