"""The start-up check of loadtests/tools/device_check.py: an engine at the default
`gpu_memory_utilization` over a model at its full context, its memory plan and start-up phases
recorded, and one request of the full context served."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from model import LLM, SamplingParams
from model.config import EngineConfig
from model.engine.memory import GiB

NEW_TOKENS = 8


def long_context_copy(directory: Path, target: Path, context: int, rope_scaling: dict | None) -> Path:
    """`directory`'s checkpoint with its max_position_embeddings raised to `context` (and
    `rope_scaling` set, as Llama 3.1's config has it): the weights linked, not copied."""
    target.mkdir(parents=True, exist_ok=True)
    for f in directory.iterdir():
        if f.name != "config.json" and not (target / f.name).exists():
            (target / f.name).symlink_to(f.resolve())
    raw = json.loads((directory / "config.json").read_text())
    raw["max_position_embeddings"] = context
    if rope_scaling is not None:
        raw["rope_scaling"] = rope_scaling
    (target / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return target


def full_context_startup(directory: Path, device: str, dtype: torch.dtype, vocab: int) -> dict[str, Any]:
    """Start an engine with nothing but the model (gpu_memory_utilization's default on CUDA, the
    CPU's default cache there), then serve one request whose prompt and output fill max_model_len."""
    t0 = time.perf_counter()
    llm = LLM(str(directory), device=device, dtype=str(dtype).removeprefix("torch."), engine_config=EngineConfig())
    built_s = time.perf_counter() - t0
    rt = llm.engine.runtime
    prompt = torch.randint(1, vocab, (rt.max_model_len - NEW_TOKENS,), generator=torch.Generator().manual_seed(0))
    t1 = time.perf_counter()
    out = llm.generate([prompt.tolist()], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))[0]
    served_s = time.perf_counter() - t1
    detail = {"max_model_len": rt.max_model_len, "num_kv_blocks": rt.num_kv_blocks,
              "kv_cache_gib": round(rt.kv_cache_bytes / GiB, 2), "weights_gib": round(rt.weights_bytes / GiB, 2),
              "activation_peak_gib": round(rt.activation_peak_bytes / GiB, 3),
              "max_concurrency": round(rt.max_concurrency, 2),
              "startup_seconds": {k: round(v, 2) for k, v in rt.startup_seconds.items()},
              "build_s": round(built_s, 1), "full_context_request_s": round(served_s, 1),
              "generated": len(out.token_ids), "finish_reason": out.finish_reason}
    del llm
    return detail
