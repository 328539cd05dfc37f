"""Weight-only quantization at load time: which linear layers become `QuantizedLinear`, and how
their weights reach them.

- On the fly (`quantization` int8 | int4): the model is built on the meta device, its linear
  layers are swapped for empty quantized ones, and the checkpoint loader quantizes each float
  tensor as it reads it (`WeightSink`), so the float weights of a layer exist only while that
  one tensor is loaded. Presets (random weights) are built in full, then swapped layer by layer.
- From a checkpoint (config.json `quantization_config`): GPTQ (`model.loading.quant.gptq`) and AWQ
  (`model.loading.quant.awq`) tensors are read and repacked into the same layers.

The LM head is quantized only with `quantize_lm_head` (with the layers' scheme, or int8:
`head_scheme`); embeddings are never (a lookup reads a few rows, not the matrix), except a tied
head's, which looks rows up in the quantized head.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from model.layers.linear.quantized import QuantizedEmbedding, QuantizedLinear, WeightSink
from model.loading.quant.awq import awq_scheme
from model.loading.quant.gptq import gptq_scheme
from model.loading.quant.scheme import QuantScheme
from model.models.weight_map import CheckpointError, TensorSpec

logger = logging.getLogger(__name__)

HEAD_NAMES = ("lm_head",)


def on_the_fly_scheme(quantization: str, group_size: int) -> QuantScheme | None:
    """EngineConfig.quantization -> its scheme (None for "none")."""
    if quantization == "none":
        return None
    if quantization == "int8":
        return QuantScheme("int8", 8, -1, sym=True)
    if quantization == "int4":
        return QuantScheme("int4", 4, group_size)
    raise ValueError(f"quantization must be none, int8 or int4; got {quantization!r}")


def head_scheme(quantize_lm_head: bool | str, layers: QuantScheme | None, device: torch.device) -> QuantScheme | None:
    """The scheme the LM head is quantized with (None: full precision), from `quantize_lm_head`
    (EngineConfig's) and the layers' on-the-fly scheme: True the layers', "int8" int8 with one
    scale per row, "auto" int8 on the CPU, full precision elsewhere."""
    if layers is None or quantize_lm_head is False:
        return None
    if quantize_lm_head == "auto":
        quantize_lm_head = "int8" if device.type == "cpu" else False
    if quantize_lm_head == "int8":
        return on_the_fly_scheme("int8", layers.group_size)
    return layers if quantize_lm_head is True else None


def checkpoint_scheme(raw: dict[str, Any], where: str) -> QuantScheme | None:
    """config.json's `quantization_config` -> its scheme, None when there is none; CheckpointError
    naming the field and value for a format or variant that is not supported."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"quantization_config in {where} must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "gptq":
        return gptq_scheme(qc, where)
    if method == "awq":
        return awq_scheme(qc, where)
    if method == "mxfp4":  # gpt-oss's experts: dequantized as they are read (model.models.expert_weights)
        return None
    raise CheckpointError(f"quantization_config.quant_method {method!r} in {where} is not supported: "
                          "supported are gptq and awq (or quantization=int8|int4 on a float checkpoint)")


def _targets(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(path, parent, attribute, layer) of every nn.Linear but the model's own LM head (which
    `compute_logits` reads as a matrix; see `quantize_head`) and those under the model's
    `float_prefixes` (a vision tower, which stays in float as vLLM keeps it)."""
    out = []
    floats = tuple(getattr(model, "float_prefixes", ()))
    for name, parent in model.named_modules():
        if floats and f"{name}.".startswith(floats):
            continue
        for attr, child in parent.named_children():
            if isinstance(child, nn.Linear) and (name or attr not in HEAD_NAMES):
                out.append((f"{name}.{attr}".lstrip("."), parent, attr, child))
    return out


def _layer_group(scheme: QuantScheme, in_features: int, where: str) -> int:
    group = in_features if scheme.group_size == -1 else scheme.group_size
    if in_features % group:
        raise ValueError(f"quantization group size {group} does not divide in_features {in_features} of {where}; "
                         "choose a group size that divides every linear layer's input width")
    if scheme.bits == 4 and group % 32:
        raise ValueError(f"4-bit layers need groups of a multiple of 32 columns; {where} has in_features "
                         f"{in_features} and group size {group}")
    return group


def swap_linears(model: nn.Module, scheme: QuantScheme, keep: Callable[[str], bool] | None = None) -> None:
    """Replace the model's nn.Linear layers (those whose path `keep` accepts; default all) by
    QuantizedLinear on the same device, one at a time: a layer with real weights is quantized
    from them and dropped (presets); a meta layer becomes an empty quantized one for the loader."""
    for where, parent, attr, linear in _targets(model):
        if keep is not None and not keep(where):
            continue
        group = _layer_group(scheme, linear.in_features, where)
        layer = QuantizedLinear(linear.in_features, linear.out_features, scheme.bits, group, linear.bias is not None,
                                has_offsets=scheme.method != "int8", act_order=scheme.desc_act,
                                device=linear.weight.device)
        if linear.weight.device.type != "meta":
            with torch.no_grad():
                layer.quantize_from(linear.weight)
                if linear.bias is not None:
                    layer.bias.copy_(linear.bias)
        setattr(parent, attr, layer)
    model.quant_scheme = scheme


def weight_sinks(model: nn.Module) -> dict[str, WeightSink]:
    """`<layer>.weight` -> its sink, for every quantized layer (what the loader copies into)."""
    return {f"{name}.weight": WeightSink(m) for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def checkpoint_names(model: nn.Module, names: dict[str, TensorSpec], scheme: QuantScheme,
                     index: Any) -> dict[str, TensorSpec]:
    """The loader's name map with each quantized layer's `weight` read from the format's tensors
    (`<prefix>.qweight`, `.qzeros`, `.scales`, ...) by the format's loader."""
    sinks = weight_sinks(model)
    out = dict(names)
    for ours, spec in names.items():
        if ours not in sinks:
            continue
        if not spec.name.endswith(".weight"):
            raise CheckpointError(f"cannot place the quantized tensors of {spec.name!r}")
        base = spec.name.removesuffix(".weight")
        sources = [base + s for s in scheme.suffixes]
        sources += [base + s for s in scheme.optional_suffixes if base + s in index]
        out[ours] = TensorSpec(base + ".qweight", sources=tuple(sources), load=_load_with(scheme, base))
    return out


def _load_with(scheme: QuantScheme, base: str) -> Callable[[Any, WeightSink], None]:
    def load(index: Any, sink: WeightSink) -> None:
        scheme.loader(index, base, sink.layer)
    return load


def quantize_head(model: nn.Module, scheme: QuantScheme) -> None:
    """Quantize the matrix `compute_logits` reads into a head layer that `compute_logits` calls.
    A separate (untied) head is replaced; a tied head's token embedding becomes a lookup into
    the same quantized matrix (the float table is dropped: one quantized copy serves both)."""
    untied = getattr(model, "lm_head", None)
    embed_name = "embed_tokens" if hasattr(model, "embed_tokens") else "wte"
    embed = getattr(model, embed_name)
    weight = untied.weight if isinstance(untied, nn.Linear) else embed.weight
    n, k = weight.shape
    layer = QuantizedLinear(k, n, scheme.bits, _layer_group(scheme, k, "the LM head"), False,
                            has_offsets=scheme.method != "int8", device=weight.device)
    layer.quantize_from(weight)
    if isinstance(untied, nn.Linear):
        model.lm_head = None
        model.quantized_head = layer
    else:
        setattr(model, embed_name, QuantizedEmbedding(layer, weight.dtype))
    # The model classes compute logits from the head's weight matrix, which a quantized head
    # does not have: its own forward is the product, followed by what the model applies after
    # it (`finish_logits`, e.g. Gemma 2's soft-cap).
    finish = getattr(model, "finish_logits", None)
    object.__setattr__(model, "compute_logits", layer if finish is None else _Then(layer, finish))


class _Then:
    """head(hidden), then finish(logits): a quantized head's logits for a model that post-processes them."""

    def __init__(self, head: QuantizedLinear, finish: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.head, self.finish = head, finish

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.finish(self.head(hidden))


def resident_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (its weights in memory)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def quantization_of(model: nn.Module) -> QuantScheme | None:
    """The scheme the model's quantized layers hold (None: full precision)."""
    return getattr(model, "quant_scheme", None)


def set_int8_activations(model: nn.Module, enabled: bool) -> int:
    """Set every quantized layer's `int8_activations`; the number of layers set."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for layer in layers:
        layer.int8_activations = enabled
    return len(layers)


def loadable_tensors(model: nn.Module) -> dict[str, Any]:
    """What the loader fills, by our name: the parameters, and a sink per quantized layer."""
    return {**dict(model.named_parameters()), **weight_sinks(model)}


def load_scheme(raw: dict[str, Any], where: str, on_the_fly: QuantScheme | None,
                quantize_lm_head: bool) -> QuantScheme | None:
    """The scheme a checkpoint loads with: its own `quantization_config`'s, else `on_the_fly`'s.
    Asking to quantize an already quantized checkpoint is a ValueError."""
    stored = checkpoint_scheme(raw, where)
    if stored is not None and on_the_fly is not None:
        raise ValueError(f"the checkpoint is already quantized ({stored.method}, {where}); "
                         f"quantization={on_the_fly.method} applies to float checkpoints: use quantization=none")
    if stored is not None and quantize_lm_head:
        raise ValueError("quantize_lm_head applies to quantization=int8|int4 on float checkpoints, "
                         f"not to a {stored.method} checkpoint")
    return stored or on_the_fly


def prepare_layers(meta_model: nn.Module, scheme: QuantScheme | None, names: dict[str, TensorSpec],
                   index: Any) -> None:
    """Swap the meta model's linear layers for quantized ones before its memory is allocated: all
    of them on the fly; for a checkpoint format, those the checkpoint holds quantized
    (`<prefix>.qweight`; a layer it keeps in float, e.g. `modules_to_not_convert`, stays float)."""
    if scheme is None:
        return
    if scheme.loader is None:
        swap_linears(meta_model, scheme)
        return

    def stored_quantized(where: str) -> bool:
        spec = names.get(f"{where}.weight")
        return spec is not None and spec.name.removesuffix(".weight") + ".qweight" in index

    swap_linears(meta_model, scheme, keep=stored_quantized)
