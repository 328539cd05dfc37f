"""Where a model comes from (a named preset or a checkpoint directory) and where it runs."""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from model.config import PRESETS, ModelConfig
from model.registry import build_model
from model.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    """"auto" picks CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device, checkpoint: torch.dtype | None = None) -> torch.dtype:
    """"auto" is float32 on CPU; on CUDA, the checkpoint's dtype when it is a 16-bit one
    (`checkpoint`, from `model_dtype`), else bfloat16."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def model_dtype(model: str) -> torch.dtype | None:
    """The dtype a checkpoint directory's weights are stored in (None for presets and unknowns)."""
    if model in PRESETS or not os.path.isdir(model):
        return None
    from model.checkpoint import CheckpointError, checkpoint_dtype

    try:
        return checkpoint_dtype(model)
    except CheckpointError:
        return None  # load_weights reports what is wrong with the directory


def build_preset(name: str) -> nn.Module:
    """A preset's model with its seeded random weights, in float32 on the CPU."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    model = build_model(cfg)
    model.init_weights(cfg.init_seed)
    return model


def load_weights(model: str, dtype: torch.dtype, device: torch.device) -> tuple[ModelConfig, nn.Module, Tokenizer]:
    """A preset name or a checkpoint directory -> config, model in eval mode, tokenizer."""
    if model in PRESETS:
        net = build_preset(model).to(device=device, dtype=dtype)
        cfg = net.cfg
        tokenizer = load_tokenizer(None, cfg.vocab_size)
    elif os.path.isdir(model):
        from model.checkpoint import load_model

        cfg, net = load_model(model, dtype=dtype, device=str(device))
        tokenizer = load_tokenizer(model, cfg.vocab_size)
    else:
        raise ValueError(f"model must be a preset ({', '.join(PRESETS)}) or a checkpoint directory; "
                         f"{model!r} is neither")
    return cfg, net.eval(), tokenizer
