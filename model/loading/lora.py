"""LoRA adapters in the PEFT format: `adapter_config.json` + `adapter_model.safetensors`.

An adapter's tensors are named after the HF model's modules under `base_model.model.`
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, GPT-2's fused
`base_model.model.transformer.h.0.attn.c_attn.lora_A.weight`); the base architecture's weight-name
map turns them into ours. lora_A is (r, in) and lora_B (out, r) for every layer kind, HF's
Conv1D included (PEFT keeps A and B as nn.Linear weights; only the base weight is transposed).
PEFT's scale: lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`; it is folded into B.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model.loading.hub import _download, is_hub_id
from model.loading.weight_files import TensorIndex, weight_files
from model.models.registry import architecture_of, build_model

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# PEFT options that change what the adapter computes and are not implemented: refused, not ignored.
# (field, the value that means "off")
_UNSUPPORTED: tuple[tuple[str, Any], ...] = (
    ("modules_to_save", None), ("use_dora", False), ("bias", "none"), ("lora_bias", False),
    ("rank_pattern", {}), ("alpha_pattern", {}), ("target_parameters", None), ("layer_replication", None),
    ("trainable_token_indices", None), ("alora_invocation_tokens", None), ("use_qalora", False),
    ("use_bdlora", None), ("kasa_config", None), ("monteclora_config", None), ("velora_config", None),
)


class LoraError(ValueError):
    """An adapter that cannot be served on this base model; the message says why."""


class LoraNotFoundError(LoraError):
    """An adapter name that is neither registered nor found under lora_dynamic_path (HTTP 404)."""


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter: per our module name, A (r, in) and B * scale (out, r), on the CPU."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def resolve_adapter_dir(source: str) -> Path:
    """A local adapter directory, or an HF hub id's snapshot (its two adapter files)."""
    if os.path.isdir(source):
        return Path(source)
    if not is_hub_id(source):
        raise LoraError(f"LoRA adapter {source!r} is neither a directory nor an HF hub id (org/name)")
    return Path(_download(source, None, [CONFIG_FILE, WEIGHTS_FILE]))


def hf_module_names(base_dir: str | None, model: nn.Module) -> dict[str, str]:
    """HF module name (`model.layers.0.self_attn.q_proj`) -> ours (`layers.0.self_attn.q_proj`),
    from the base checkpoint's architecture name map (built on a meta copy of the model)."""
    if base_dir is None:
        raise LoraError("LoRA adapters need a checkpoint (an HF architecture) as the base model, not a preset")
    raw = json.loads((Path(base_dir) / "config.json").read_text("utf-8"))
    _, spec = architecture_of(raw, base_dir)
    with torch.device("meta"):
        meta = build_model(model.cfg)
    index = TensorIndex(weight_files(Path(base_dir)))
    out = {}
    for ours, tensor in spec.name_map(meta, index).items():
        if ours.endswith(".weight") and tensor.name.endswith(".weight"):
            out[tensor.name.removesuffix(".weight")] = ours.removesuffix(".weight")
    return out


def read_adapter_config(directory: Path) -> dict[str, Any]:
    """adapter_config.json, checked: a LoRA, with no option this server does not implement."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise LoraError(f"{directory} has no {CONFIG_FILE}: not a PEFT adapter directory")
    raw = json.loads(path.read_text("utf-8"))
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{path}: peft_type must be LORA, got {raw['peft_type']!r}")
    for field, off in _UNSUPPORTED:
        value = raw.get(field, off)
        if value not in (off, None, {}, [], False):
            raise LoraError(f"{path}: {field}={value!r} is not supported (LoRA adapters are served with "
                            f"{field}={off!r})")
    if not isinstance(raw.get("r"), int) or raw["r"] < 1:
        raise LoraError(f"{path}: r must be an integer >= 1, got {raw.get('r')!r}")
    return raw


def load_adapter(name: str, source: str, modules: dict[str, str], targets: dict[str, Any],
                 max_rank: int, dtype: torch.dtype) -> LoraAdapter:
    """Read and check one adapter against the base model: `modules` maps HF module names to ours
    (`hf_module_names`), `targets` what an adapter may target by our name (each with its
    `in_features` and `out_features`). Raises LoraError."""
    directory = resolve_adapter_dir(source)
    raw = read_adapter_config(directory)
    r, alpha = raw["r"], float(raw.get("lora_alpha", raw["r"]))
    if r > max_rank:
        raise LoraError(f"adapter {name!r} has rank {r}, above max_lora_rank={max_rank}")
    scale = alpha / math.sqrt(r) if raw.get("use_rslora") else alpha / r
    file = directory / WEIGHTS_FILE
    if not file.is_file():
        raise LoraError(f"{directory} has no {WEIGHTS_FILE} (only safetensors adapters are read)")
    index = TensorIndex([file])
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key in index:
        module, _, kind = key.rpartition(".lora_")
        if kind not in ("A.weight", "B.weight") or not module.startswith(_PREFIX):
            raise LoraError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a linear layer")
        pairs.setdefault(module.removeprefix(_PREFIX), {})[kind[0]] = index.get_tensor(key)
    base = raw.get("base_model_name_or_path")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for hf_name, ab in sorted(pairs.items()):
        ours = modules.get(hf_name)
        if ours is None or ours not in targets:
            raise LoraError(f"adapter {name!r} targets {hf_name!r}, which is not a linear layer of this base "
                            f"model (the adapter was made for {base!r})")
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: {hf_name!r} has lora_A or lora_B missing")
        a, b, layer = ab["A"], ab["B"], targets[ours]
        want_a, want_b = (r, layer.in_features), (layer.out_features, r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoraError(f"adapter {name!r}: {hf_name!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                            f"this base model needs {want_a} and {want_b} (r={r}; made for {base!r})")
        weights[ours] = (a.to(dtype), (b.float() * scale).to(dtype))
    if not weights:
        raise LoraError(f"adapter {name!r} in {directory} has no LoRA weights")
    logger.info("LoRA adapter %s: %s, rank %d, scale %g, %d layers", name, directory, r, scale, len(weights))
    return LoraAdapter(name, str(directory), r, scale, weights)
