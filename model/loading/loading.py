"""Where a model comes from (a named preset, a checkpoint directory or an HF hub id) and where it runs."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from model.config import PRESETS, ModelConfig
from model.layers.linear.dense import kernel_available as dense_kernel_available
from model.layers.linear.kernel import kernel_available
from model.loading.generation_config import GenerationConfig, load_generation_config
from model.loading.hub import resolve_model_dir
from model.loading.quant.quantize import quantize_head, swap_linears
from model.loading.quant.scheme import QuantScheme
from model.loading.tokenizer import Tokenizer, load_tokenizer
from model.models.registry import build_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Presets with trained weights, shipped inside the package (half precision) and loaded like any
# checkpoint directory. `python -m model.training.train` made them; the directory's training.json says how.
TRAINED_PRESETS: dict[str, Path] = {
    "transformer-base-trained": Path(__file__).resolve().parents[1] / "weights" / "transformer-base-trained",
    # A speculative-decoding draft for it (docs/features/speculative-decoding.md): transformer-draft-small's shape.
    "transformer-draft-trained": Path(__file__).resolve().parents[1] / "weights" / "transformer-draft-trained",
}


def preset_names() -> list[str]:
    """Every preset a `model` argument may name: the seeded random ones, then the trained ones."""
    return [*PRESETS, *TRAINED_PRESETS]


def is_preset(model: str) -> bool:
    return model in PRESETS or model in TRAINED_PRESETS


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
    from model.loading.checkpoint import CheckpointError, checkpoint_dtype

    try:
        return checkpoint_dtype(model)
    except CheckpointError:
        return None  # load_weights reports what is wrong with the directory


def build_preset(name: str) -> nn.Module:
    """A preset's model with its seeded random weights, in float32 on the CPU."""
    if name not in PRESETS:
        raise ValueError(f"unknown random-weight preset {name!r}; presets: {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    model = build_model(cfg)
    model.init_weights(cfg.init_seed)
    return model


def resolve_model(model: str, revision: str | None = None) -> str:
    """A random preset's name as it is; a trained preset, a checkpoint directory or an HF hub
    id (at `revision`, see `model.loading.hub`) -> the checkpoint directory. Raises ValueError for
    anything else."""
    if model in PRESETS:
        return model
    if model in TRAINED_PRESETS:
        directory = TRAINED_PRESETS[model]
        if not (directory / "model.safetensors").is_file():
            raise ValueError(f"the weights of preset {model!r} are missing from {directory} (an incomplete "
                             "installation or checkout)")
        return str(directory)
    directory = resolve_model_dir(model, revision)
    if directory is None:
        raise ValueError(f"model must be a preset ({', '.join(preset_names())}), a checkpoint directory or an HF hub "
                         f"id (org/name); {model!r} is none of these")
    return directory


def load_weights(model: str, dtype: torch.dtype, device: torch.device, revision: str | None = None,
                 quantize: QuantScheme | None = None, quantize_lm_head: bool | QuantScheme = False,
                 ) -> tuple[ModelConfig, nn.Module, Tokenizer, GenerationConfig]:
    """A preset name, a checkpoint directory or an HF hub id (see `resolve_model`) -> config,
    model in eval mode, tokenizer, generation config. `quantize`: quantize the linear layers as
    they load (and the LM head with `quantize_lm_head`: True with their scheme, or a scheme of its
    own); a GPTQ/AWQ checkpoint loads as it is."""
    model = resolve_model(model, revision)
    if model in PRESETS:
        net = build_preset(model).to(device=device, dtype=dtype)
        if quantize is not None:  # random weights: built in full, then quantized layer by layer
            swap_linears(net, quantize)
            if quantize_lm_head:
                quantize_head(net, quantize if quantize_lm_head is True else quantize_lm_head)
        cfg = net.cfg
        tokenizer = load_tokenizer(None, cfg.vocab_size)
        generation = GenerationConfig()
    else:
        from model.loading.checkpoint import load_model

        cfg, net = load_model(model, dtype=dtype, device=str(device), quantize=quantize,
                              quantize_lm_head=quantize_lm_head)
        tokenizer = load_tokenizer(model, cfg.vocab_size)
        generation = load_generation_config(model)
    if device.type == "cpu" and getattr(net, "quant_scheme", None) is not None:
        kernel_available()  # build the quantized-matmul kernel now (a minute or two), not on the first request
    if device.type == "cpu" and dtype == torch.float32:
        dense_kernel_available()  # the few-row float32 products' kernel, likewise
    return cfg, net.eval(), tokenizer, generation
