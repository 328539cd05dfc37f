"""qkv-serve's model package: the Transformer, its KV cache and the continuous-batching engine.

One sub-package per part: `engine` (engine, scheduler, block manager, sequence, runner),
`layers` (attention over the paged KV cache and its backends, positions, norms, MLPs),
`models` (the registry and one module per architecture family), `loading` (presets,
checkpoints, hub, tokenizers), `sampling` (SamplingParams, the sampler, structured outputs,
request checks), `inspect` (attention maps), `training`, and `weights` (the trained default).

Names are imported lazily so that the torch-free modules (`engine.sequence`,
`engine.block_manager`, `engine.scheduler`, `sampling.params`, `sampling.request_checks`,
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
