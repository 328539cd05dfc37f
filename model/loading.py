"""Where a model comes from (a named preset or a checkpoint directory) and where it runs."""

from __future__ import annotations

import logging
import os

import torch

from model.config import PRESETS, ModelConfig
from model.tokenizer import Tokenizer, load_tokenizer
from model.transformer import Transformer

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


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto" is float32 on CPU and bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def build_preset(name: str) -> Transformer:
    """A preset's model with its seeded random weights, in float32 on the CPU."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    model = Transformer(cfg)
    model.init_weights(cfg.init_seed)
    return model


def load_weights(model: str, dtype: torch.dtype, device: torch.device) -> tuple[ModelConfig, Transformer, Tokenizer]:
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
