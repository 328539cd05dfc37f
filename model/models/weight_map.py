"""What an architecture family tells the checkpoint loader: how to read its `config.json`,
and where each of our parameters lives among the checkpoint's tensors."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model.config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message says what is wrong."""


@dataclass(frozen=True)
class TensorSpec:
    """Where one of our parameters lives in a checkpoint."""

    name: str  # the checkpoint's tensor name
    transpose: bool = False  # stored (in, out) by HF's Conv1D; nn.Linear holds (out, in)
    # A parameter assembled from several checkpoint tensors (stacked experts, MXFP4 blocks and
    # scales): `load(index, param)` reads `sources` one at a time into `param` and checks their shapes.
    sources: tuple[str, ...] = ()
    load: Callable[[Any, torch.Tensor], None] | None = None


# A checkpoint's tensors (`model.loading.weight_files.TensorIndex`): `name in index`, `index.get_tensor(name)`.
TensorSource = Any


def _skip_nothing(cfg: ModelConfig, name: str) -> bool:
    return False


@dataclass(frozen=True)
class ArchitectureSpec:
    """One `architectures[0]` value: its config parser and weight-name map.

    - `parse_config(raw, has_tokenizer)`: config.json -> ModelConfig; raises CheckpointError.
    - `name_map(model, tensor_names)`: our parameter name -> TensorSpec in the checkpoint.
    - `skip(cfg, tensor_name)`: checkpoint tensors that are not loaded (buffers, a tied head).
    - `verify(model, index, where)`: checks after loading (e.g. a stored head equals the
      embedding); raises CheckpointError.
    - `config_json(cfg)`: the config.json `save_model` writes; None: saving is not supported.
    """

    parse_config: Callable[[dict[str, Any], bool], ModelConfig]
    name_map: Callable[[nn.Module, Collection[str]], dict[str, TensorSpec]]
    skip: Callable[[ModelConfig, str], bool] = _skip_nothing
    verify: Callable[[nn.Module, TensorSource, str], None] | None = None
    config_json: Callable[[ModelConfig], dict[str, Any]] | None = None


def identity_map(model: nn.Module, prefix: str = "") -> dict[str, TensorSpec]:
    """Every parameter stored under its own name (after `prefix`)."""
    return {ours: TensorSpec(prefix + ours) for ours, _ in model.named_parameters()}
