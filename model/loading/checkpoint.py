"""HF-style checkpoint directories: `config.json` + `model.safetensors` (or shards listed in
`model.safetensors.index.json`), read and written without `transformers`.

The architecture (`config.json`'s `architectures[0]`) picks a spec from `model.models.registry`:
its config parser and its weight-name map (our parameter name -> the checkpoint's tensor).
Weights are copied tensor by tensor into a model allocated once at the target dtype, so
loading a bf16 checkpoint into float32 peaks near one float32 copy of the model plus one tensor.
The tokenizer (`tokenizer.json`) is read by `model.loading.tokenizer.load_tokenizer`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from model.config import ModelConfig
from model.loading.quant.quantize import checkpoint_names, load_scheme, loadable_tensors, prepare_layers, quantize_head
from model.loading.quant.scheme import QuantScheme
from model.loading.weight_files import INDEX_FILE, WEIGHTS_FILE, TensorIndex, weight_files
from model.models.registry import ARCHITECTURES, SUPPORTED_ARCHITECTURES, architecture_of, build_model
from model.models.weight_map import ArchitectureSpec, CheckpointError, TensorSpec

__all__ = ["CheckpointError", "INDEX_FILE", "SUPPORTED_ARCHITECTURES", "WEIGHTS_FILE", "checkpoint_dtype",
           "load_config", "load_model", "save_model"]

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
PROGRESS_MIN_BYTES = 100 * 2**20  # show a progress bar for loads above this
_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _read_config(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"no {CONFIG_FILE} in checkpoint directory {directory}: it is required")
    try:
        raw = json.loads(file.read_text("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _parse(directory: Path) -> tuple[ModelConfig, ArchitectureSpec]:
    raw = _read_config(directory)
    _, spec = architecture_of(raw, str(directory / CONFIG_FILE))
    try:
        return spec.parse_config(raw, (directory / TOKENIZER_FILE).is_file()), spec
    except CheckpointError:
        raise
    except KeyError as e:
        raise CheckpointError(f"bad {directory / CONFIG_FILE}: required field {e.args[0]!r} is missing") from e
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"bad {directory / CONFIG_FILE}: {e}") from e


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory, without reading its weights."""
    return _parse(Path(path))[0]


def checkpoint_dtype(path: str | Path) -> torch.dtype | None:
    """The dtype config.json says the weights are stored in (`dtype`, or the older
    `torch_dtype`); None when it says nothing usable."""
    raw = _read_config(Path(path))
    return _DTYPE_NAMES.get(str(raw.get("dtype") or raw.get("torch_dtype")))


def _listing(names: list[str], limit: int = 10) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _check_tensors(model: nn.Module, spec: ArchitectureSpec, names: dict[str, TensorSpec], index: TensorIndex,
                   directory: Path) -> None:
    """Every expected tensor is there, nothing else is, and every shape matches the config."""
    expected = {n for t in names.values() for n in (t.sources or (t.name,))}
    found = {n for n in index if not spec.skip(model.cfg, n)}
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing:
        raise CheckpointError(f"checkpoint {directory} is missing tensors: {_listing(missing)}")
    if unexpected:
        raise CheckpointError(f"checkpoint {directory} has unexpected tensors: {_listing(unexpected)}")
    params = loadable_tensors(model)  # quantized layers take their weight through a sink
    for ours, t in names.items():
        if t.load is not None:  # checks its sources' shapes as it reads them
            continue
        want = tuple(params[ours].shape)
        want = want[::-1] if t.transpose else want
        got = index.shape(t.name)
        if got != want:
            raise CheckpointError(
                f"tensor {t.name!r} has shape {list(got)}, expected {list(want)} from {CONFIG_FILE} in {directory}"
            )


@torch.no_grad()
def _copy_weights(model: nn.Module, names: dict[str, TensorSpec], index: TensorIndex, directory: Path) -> None:
    """Read each tensor and copy it into its parameter, one at a time; `copy_` converts the
    dtype on the way, so at most one tensor exists twice."""
    params = loadable_tensors(model)
    total = sum(p.numel() * p.element_size() for p in params.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {directory.name}",
              disable=total < PROGRESS_MIN_BYTES) as bar:
        for ours, t in names.items():
            if t.load is not None:
                t.load(index, params[ours])
            else:
                tensor = index.get_tensor(t.name)
                params[ours].copy_(tensor.t() if t.transpose else tensor)
                del tensor
            bar.update(params[ours].numel() * params[ours].element_size())


def _name_map(model: nn.Module, spec: ArchitectureSpec, tensor_names: Any) -> dict[str, TensorSpec]:
    """The spec's name map, checked to cover exactly the model's parameters."""
    names = spec.name_map(model, tensor_names)
    params = {n for n, _ in model.named_parameters()}
    assert set(names) == params, f"name map out of date: {sorted(set(names) ^ params)}"
    return names


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: str) -> nn.Module:
    """The model with uninitialised parameters, allocated once on `device` in `dtype`
    (built on the meta device: no random init, no float32 detour)."""
    with torch.device("meta"):
        model = build_model(cfg)
    check_no_constant_buffers(model)
    return model.to(dtype=dtype).to_empty(device=device)


def check_no_constant_buffers(model: nn.Module) -> None:
    """A non-persistent buffer (a constant table the model computes itself) comes out of the meta
    device uninitialised, and no checkpoint fills it: refuse one, naming it. Such tables are
    `model.layers.positions.PerDevice` constants instead."""
    found = sorted(set(dict(model.named_buffers())) - set(model.state_dict()))
    if found:
        raise TypeError(f"{type(model).__name__} registers non-persistent buffers ({', '.join(found)}), which "
                        "loading through the meta device leaves uninitialised; keep constant tables as "
                        "model.layers.positions.PerDevice")


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               quantize: QuantScheme | None = None,
               quantize_lm_head: bool | QuantScheme = False) -> tuple[ModelConfig, nn.Module]:
    """Load a checkpoint directory into its model (eval mode) on `device` in `dtype`.

    Raises `CheckpointError` naming what is missing, unexpected or of the wrong shape.
    """
    directory = Path(path)
    cfg, spec = _parse(directory)
    files = weight_files(directory)
    index = TensorIndex(files)
    scheme = load_scheme(_read_config(directory), str(directory / CONFIG_FILE), quantize, quantize_lm_head)
    if scheme is None:
        model = _empty_model(cfg, dtype, device).eval()
        names = _name_map(model, spec, index)
    else:  # linear layers become quantized ones on the meta device, before anything is allocated
        with torch.device("meta"):
            meta = build_model(cfg).to(dtype=dtype)
        names = _name_map(meta, spec, index)
        prepare_layers(meta, scheme, names, index)
        model = meta.to_empty(device=device).eval()
        if scheme.loader is not None:
            names = checkpoint_names(model, names, scheme, index)
    _check_tensors(model, spec, names, index, directory)
    _copy_weights(model, names, index, directory)
    if spec.verify is not None:
        spec.verify(model, index, str(directory))
    if quantize_lm_head:  # True: as the layers; a scheme: the head's own (int8 beside int4 layers)
        quantize_head(model, scheme if quantize_lm_head is True else quantize_lm_head)
    logger.info("loaded %s (%s, %d tensors from %d file(s)) as %s on %s",
                directory, cfg.arch, len(names), len(files), dtype, device)
    return cfg, model


def save_model(model: nn.Module, path: str | Path) -> None:
    """Write `config.json` + `model.safetensors`: GPT2LMHeadModel's layout for the gpt2 arch
    (loadable by HF transformers), QKVTransformerForCausalLM with our names for the paper's."""
    arch = {"transformer": "QKVTransformerForCausalLM", "gpt2": "GPT2LMHeadModel"}.get(model.cfg.arch)
    if arch is None:
        raise ValueError(f"save_model writes the transformer and gpt2 archs, not {model.cfg.arch!r}")
    spec = ARCHITECTURES[arch]
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    names = _name_map(model, spec, ["transformer.wte.weight"])  # GPT2LMHeadModel's prefixed names
    tensors = {}
    for ours, t in names.items():
        tensor = params[ours].detach()
        tensors[t.name] = (tensor.t() if t.transpose else tensor).contiguous().cpu()
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    dtype = str(next(iter(params.values())).dtype).removeprefix("torch.")
    config = {**spec.config_json(model.cfg), "dtype": dtype}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", "utf-8")
    logger.info("saved %s (%s, %d tensors)", directory, model.cfg.arch, len(tensors))
