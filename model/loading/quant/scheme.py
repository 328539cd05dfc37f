"""What a model's quantized layers hold (`QuantScheme`), shared by the on-the-fly path and the
checkpoint formats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model.layers.linear.quantized import QuantizedLinear


@dataclass(frozen=True)
class QuantScheme:
    """What a model's quantized layers hold. `group_size` -1: one group per row."""

    method: str  # int8 | int4 | gptq | awq
    bits: int
    group_size: int
    sym: bool = False
    desc_act: bool = False
    # Checkpoint formats: (index, tensor-name prefix, layer) -> fills the layer from the checkpoint.
    loader: Callable[[Any, str, QuantizedLinear], None] | None = None
    suffixes: tuple[str, ...] = ()  # the tensors one quantized layer has in the checkpoint
    optional_suffixes: tuple[str, ...] = ()  # ...and those it may have

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "bits": self.bits, "group_size": self.group_size}
        if self.method in ("gptq", "awq"):
            out["sym"] = self.sym
        if self.method == "gptq":
            out["desc_act"] = self.desc_act
        return out
