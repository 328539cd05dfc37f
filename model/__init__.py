"""qkv-serve's model package: the Transformer, its KV cache and the continuous-batching engine.

Names are imported lazily so that the torch-free modules (`sequence`, `block_manager`,
`scheduler`, `sampling_params`) can be used without importing torch.
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
