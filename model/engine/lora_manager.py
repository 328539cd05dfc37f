"""The LoRA adapters one engine serves at run time: which are known, which are loaded, and which
sit in the wrapped layers' slots (reading an adapter's files is `model.loading.lora`)."""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from model.layers.lora import wrap_lora
from model.loading.lora import LoraAdapter, LoraError, LoraNotFoundError, hf_module_names, load_adapter

logger = logging.getLogger(__name__)


class LoraManager:
    """The adapters one engine serves: names -> sources, loaded adapters (CPU, kept once read), and
    `max_loras` resident slots in the wrapped layers, evicted least recently used among the adapters
    that no in-flight request holds (`acquire` / `release`)."""

    def __init__(self, model: nn.Module, base_dir: str | None, base_name: str, lora_modules: dict[str, str] | None,
                 dynamic_path: str | None, max_loras: int, max_rank: int, dtype: torch.dtype) -> None:
        # The names `base:adapter` may use for the base model (the service adds its served name).
        self.base_names, self.dynamic_path = {base_name}, dynamic_path
        self.max_loras, self.max_rank, self.dtype = max_loras, max_rank, dtype
        self.modules = hf_module_names(base_dir, model)
        self.state, self.layers = wrap_lora(model, max_loras, max_rank)
        self.sources: dict[str, str] = dict(lora_modules or {})
        self.adapters: dict[str, LoraAdapter] = {}
        self.slot_of: dict[str, int] = {}  # resident adapters, least recently used first
        self.in_use: dict[str, int] = {}  # adapter -> requests holding it
        self.num_loads = 0  # adapters put into a slot, since start
        self.num_evictions = 0
        for name, source in self.sources.items():  # start-up adapters are checked (and read) at once
            self.adapter(name)

    def names(self) -> list[str]:
        """Adapters known by name: the start-up ones and those loaded by `base:adapter` since."""
        return list(self.sources)

    def source_of(self, name: str) -> str | None:
        """Where adapter `name` comes from: a start-up adapter, or `base:adapter` under lora_dynamic_path."""
        if name in self.sources:
            return self.sources[name]
        base, sep, adapter = name.partition(":")
        if not sep or base not in self.base_names or not adapter or self.dynamic_path is None:
            return None
        if "/" in adapter or "\\" in adapter or adapter.startswith("."):
            raise LoraError(f"adapter name {adapter!r} must be a plain name under lora_dynamic_path")
        if os.path.isdir(self.dynamic_path):
            return os.path.join(self.dynamic_path, adapter)
        return f"{self.dynamic_path.rstrip('/')}/{adapter}"  # a hub org

    def adapter(self, name: str) -> LoraAdapter:
        """The loaded adapter `name` (read on first use); LoraError for an unknown or unfit one."""
        if name not in self.adapters:
            source = self.source_of(name)
            if source is None:
                raise LoraNotFoundError(f"unknown LoRA adapter {name!r}: known are {sorted(self.sources) or 'none'}"
                                        + (f", or <base>:<adapter> under {self.dynamic_path}" if self.dynamic_path else ""))
            if name not in self.sources and os.path.isdir(self.dynamic_path) and not os.path.isdir(source):
                raise LoraNotFoundError(f"unknown LoRA adapter {name!r}: {source} is not a directory")
            self.adapters[name] = load_adapter(name, source, self.modules, self.layers, self.max_rank, self.dtype)
            self.sources.setdefault(name, source)
        return self.adapters[name]

    def acquire(self, name: str) -> int | None:
        """The slot holding `name` for one more request, loading it (evicting the least recently used
        idle adapter) if needed; None when every slot holds an adapter in use."""
        adapter = self.adapter(name)
        if name in self.slot_of:
            self.slot_of[name] = self.slot_of.pop(name)  # most recently used
        else:
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if not free:
                idle = [n for n in self.slot_of if not self.in_use.get(n)]
                if not idle:
                    return None
                free = [self.slot_of.pop(idle[0])]
                self.num_evictions += 1
                logger.info("LoRA adapter %s evicted from slot %d", idle[0], free[0])
            slot = free[0]
            for module, layer in self.layers.items():
                a, b = adapter.weights.get(module, (None, None))
                layer.set_slot(slot, a, b)
            self.slot_of[name] = slot
            self.num_loads += 1
        self.in_use[name] = self.in_use.get(name, 0) + 1
        return self.slot_of[name]

    def release(self, name: str) -> None:
        """One request holding `name` is done."""
        self.in_use[name] -= 1
