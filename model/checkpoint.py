"""HF-style checkpoint directories: `config.json` + `model.safetensors` (or shards listed in
`model.safetensors.index.json`), read and written without `transformers`.

Two layouts, each with its own name map (our parameter name -> the checkpoint's tensor):
- `GPT2LMHeadModel` / `GPT2Model`: HF GPT-2. Its Conv1D weights are stored (in, out), so they
  are transposed into our `nn.Linear` (out, in); the LM head is tied to `wte`.
- `QKVTransformerForCausalLM`: our own model; `config.json` carries the `ModelConfig` fields
  and tensors use our parameter names as they are.
The tokenizer (`tokenizer.json`) is read by `model.tokenizer.load_tokenizer`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from model.config import ModelConfig
from model.transformer import Transformer

logger = logging.getLogger(__name__)

GPT2_ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
QKV_ARCHITECTURE = "QKVTransformerForCausalLM"
SUPPORTED_ARCHITECTURES = (*GPT2_ARCHITECTURES, QKV_ARCHITECTURE)
# Both are GELU's tanh approximation, which is what our gpt2 arch computes.
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
PROGRESS_MIN_BYTES = 100 * 2**20  # show a progress bar for loads above this
# Causal-mask buffers that old GPT-2 checkpoints saved; they are not weights.
_GPT2_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
_GPT2_LM_HEAD = "lm_head.weight"
_GPT2_CONV1D = {"attn.qkv": "attn.c_attn", "attn.out": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message says what is wrong."""


@dataclass(frozen=True)
class TensorSpec:
    """Where one of our parameters lives in a checkpoint."""

    name: str  # the checkpoint's tensor name
    transpose: bool = False  # stored (in, out) by HF's Conv1D; nn.Linear holds (out, in)


def _gpt2_name_map(n_layers: int, prefix: str) -> dict[str, TensorSpec]:
    """Our parameter names -> GPT-2's (`prefix` is "transformer." for GPT2LMHeadModel keys)."""
    names = {ours: TensorSpec(prefix + ours) for ours in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")}
    for i in range(n_layers):
        for ln in ("ln_1", "ln_2"):
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{ln}.{kind}"] = TensorSpec(f"{prefix}h.{i}.{ln}.{kind}")
        for ours, theirs in _GPT2_CONV1D.items():
            names[f"blocks.{i}.{ours}.weight"] = TensorSpec(f"{prefix}h.{i}.{theirs}.weight", transpose=True)
            names[f"blocks.{i}.{ours}.bias"] = TensorSpec(f"{prefix}h.{i}.{theirs}.bias")
    return names


def _name_map(model: Transformer, prefix: str = "transformer.") -> dict[str, TensorSpec]:
    """The name map of the model's architecture, checked to cover exactly its parameters."""
    params = dict(model.named_parameters())
    if model.cfg.arch == "gpt2":
        names = _gpt2_name_map(model.cfg.n_layers, prefix)
    else:
        names = {ours: TensorSpec(ours) for ours in params}
    assert set(names) == set(params), f"name map out of date: {sorted(set(names) ^ set(params))}"
    return names


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


def _architecture(raw: dict[str, Any], file: Path) -> str:
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") == "gpt2":
        return "GPT2LMHeadModel"
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise CheckpointError(
        f"unsupported architecture {archs or None} in {file}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _gpt2_config(raw: dict[str, Any], directory: Path) -> ModelConfig:
    """GPT-2's config.json fields (HF defaults where absent) -> ModelConfig(arch="gpt2")."""
    activation = raw.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise CheckpointError(f"activation_function must be one of {', '.join(GPT2_ACTIVATIONS)}, got {activation!r}")
    for flag, allowed in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False)):
        if raw.get(flag, allowed) != allowed:
            raise CheckpointError(f"{flag} must be {allowed} for GPT-2 checkpoints, got {raw[flag]!r}")
    d_model, vocab = raw.get("n_embd", 768), raw.get("vocab_size", 50257)
    eos = raw.get("eos_token_id", 50256)
    if isinstance(eos, list):  # some configs list several end tokens
        eos = eos[0] if eos else None
    if eos is not None and not 0 <= eos < vocab:
        logger.warning("eos_token_id %s is outside the vocabulary (%d tokens): ignored", eos, vocab)
        eos = None
    return ModelConfig(
        vocab_size=vocab, d_model=d_model, n_heads=raw.get("n_head", 12), n_layers=raw.get("n_layer", 12),
        d_ff=raw.get("n_inner") or 4 * d_model, max_position=raw.get("n_positions", 1024), attention="dot",
        arch="gpt2", layer_norm_eps=raw.get("layer_norm_epsilon", 1e-5), eos_token_id=eos,
        tokenizer="hf" if (directory / TOKENIZER_FILE).is_file() else "byte",
    )


def _qkv_config(raw: dict[str, Any]) -> ModelConfig:
    """Our config.json: the ModelConfig fields, plus bookkeeping keys that are ignored."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in raw.items() if k in fields})


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory, without reading its weights."""
    directory = Path(path)
    raw = _read_config(directory)
    arch = _architecture(raw, directory / CONFIG_FILE)
    try:
        return _qkv_config(raw) if arch == QKV_ARCHITECTURE else _gpt2_config(raw, directory)
    except CheckpointError:
        raise
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"bad {directory / CONFIG_FILE}: {e}") from e


def _weight_files(directory: Path) -> list[Path]:
    """`model.safetensors`, else the shards that `model.safetensors.index.json` lists."""
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if single.is_file():
        return [single]
    if not index.is_file():
        others = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
        found = f" (found {', '.join(others)}: only safetensors weights are read)" if others else ""
        raise CheckpointError(f"no weights in {directory}: expected {WEIGHTS_FILE} or {INDEX_FILE}{found}")
    try:
        weight_map = json.loads(index.read_text("utf-8")).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a JSON object with a \"weight_map\": {e}") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no \"weight_map\"")
    files = [directory / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"weight shard {file.name} listed in {index} is missing")
    return files


def _open_tensors(files: list[Path], stack: ExitStack) -> dict[str, Any]:
    """Tensor name -> the memory-mapped `safe_open` handle of the file holding it."""
    handles: dict[str, Any] = {}
    for file in files:
        handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
        for name in handle.keys():
            if name in handles:
                raise CheckpointError(f"tensor {name!r} appears in more than one weight file ({file.name})")
            handles[name] = handle
    return handles


def _listing(names: list[str], limit: int = 10) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _check_tensors(model: Transformer, names: dict[str, TensorSpec], handles: dict[str, Any],
                   directory: Path) -> None:
    """Every expected tensor is there, nothing else is, and every shape matches the config."""
    expected = {spec.name for spec in names.values()}
    found = set(handles)
    if model.cfg.arch == "gpt2":
        found = {n for n in found if not n.endswith(_GPT2_BUFFER_SUFFIXES) and n != _GPT2_LM_HEAD}
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing:
        raise CheckpointError(f"checkpoint {directory} is missing tensors: {_listing(missing)}")
    if unexpected:
        raise CheckpointError(f"checkpoint {directory} has unexpected tensors: {_listing(unexpected)}")
    params = dict(model.named_parameters())
    for ours, spec in names.items():
        want = tuple(params[ours].shape)
        want = want[::-1] if spec.transpose else want
        got = tuple(handles[spec.name].get_slice(spec.name).get_shape())
        if got != want:
            raise CheckpointError(
                f"tensor {spec.name!r} has shape {list(got)}, expected {list(want)} from {CONFIG_FILE} in {directory}"
            )


@torch.no_grad()
def _copy_weights(model: Transformer, names: dict[str, TensorSpec], handles: dict[str, Any],
                  directory: Path) -> None:
    """Copy each tensor from the memory map straight into its parameter, one at a time."""
    params = dict(model.named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {directory.name}",
              disable=total < PROGRESS_MIN_BYTES) as bar:
        for ours, spec in names.items():
            tensor = handles[spec.name].get_tensor(spec.name)
            params[ours].copy_(tensor.t() if spec.transpose else tensor)
            bar.update(params[ours].numel() * params[ours].element_size())
    head = handles.get(_GPT2_LM_HEAD)
    if model.cfg.arch == "gpt2" and head is not None:
        lm_head = head.get_tensor(_GPT2_LM_HEAD).to(model.wte.weight)
        if lm_head.shape != model.wte.weight.shape or not torch.equal(lm_head, model.wte.weight):
            raise CheckpointError(f"{_GPT2_LM_HEAD} in {directory} differs from the token embedding: "
                                  "only tied LM heads are supported")


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str = "cpu") -> tuple[ModelConfig, Transformer]:
    """Load a checkpoint directory into a `Transformer` (eval mode) on `device` in `dtype`.

    Raises `CheckpointError` naming what is missing, unexpected or of the wrong shape.
    """
    directory = Path(path)
    cfg = load_config(directory)
    files = _weight_files(directory)
    with torch.device(device):
        model = Transformer(cfg)
    model.to(dtype=dtype).eval()
    with ExitStack() as stack:
        handles = _open_tensors(files, stack)
        prefix = "transformer." if "transformer.wte.weight" in handles else ""
        names = _name_map(model, prefix)
        _check_tensors(model, names, handles, directory)
        _copy_weights(model, names, handles, directory)
    logger.info("loaded %s (%s, %d tensors from %d file(s)) as %s on %s",
                directory, cfg.arch, len(names), len(files), dtype, device)
    return cfg, model


def _config_json(model: Transformer) -> dict[str, Any]:
    """config.json for the model: GPT-2's (as `GPT2LMHeadModel.from_pretrained` reads it) or ours."""
    cfg = model.cfg
    dtype = str(model.wte.weight.dtype).removeprefix("torch.")
    if cfg.arch != "gpt2":
        return {"architectures": [QKV_ARCHITECTURE], "model_type": "qkv-transformer",
                **dataclasses.asdict(cfg), "dtype": dtype}
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_position, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.layer_norm_eps,
        "bos_token_id": cfg.eos_token_id, "eos_token_id": cfg.eos_token_id, "tie_word_embeddings": True,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "dtype": dtype,
    }


def save_model(model: Transformer, path: str | Path) -> None:
    """Write `config.json` + `model.safetensors`: GPT2LMHeadModel's layout for the gpt2 arch
    (loadable by HF transformers), QKVTransformerForCausalLM with our names otherwise."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    tensors = {}
    for ours, spec in _name_map(model).items():
        tensor = params[ours].detach()
        tensors[spec.name] = (tensor.t() if spec.transpose else tensor).contiguous().cpu()
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(_config_json(model), indent=2) + "\n", "utf-8")
    logger.info("saved %s (%s, %d tensors)", directory, model.cfg.arch, len(tensors))
