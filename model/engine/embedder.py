"""Embeddings: the final hidden states of whole prompts, pooled as the checkpoint declares
(`model.loading.pooling_config.PoolingConfig`).

A prompt is one prefill chunk that sees only itself, so its K/V are used where they are
computed and never read back: the forward runs over a cache that discards what is written
(`DiscardKV`), and nothing of the engine's paged KV pool is taken. Several prompts share one
flat forward pass (up to `max_batch_tokens` tokens), as prefill chunks do in an engine step.
Works for every registered family, since each runs `forward(tokens, positions, meta, cache)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.layers.kv_cache import AttnMetadata, PrefillChunk
from model.loading.pooling_config import PoolingConfig


class DiscardKV:
    """Stands in for `KVCache` in a prefill-only pass: `update` keeps nothing. Attention never
    reads it, because every chunk's context is the chunk itself (`context_len == length`)."""

    def update(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        pass


def pool(hidden: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden (L, d) of one prompt -> (d,) float32, sentence-transformers' pooling `mode`."""
    hidden = hidden.float()
    if mode == "lasttoken":
        return hidden[-1]
    if mode == "cls":
        return hidden[0]
    if mode == "max":
        return hidden.max(dim=0).values
    return hidden.mean(dim=0)


def shorten(vector: torch.Tensor, dimensions: int, normalize: bool) -> torch.Tensor:
    """Matryoshka truncation: the first `dimensions` values, renormalized when the model normalizes."""
    if dimensions >= vector.shape[0]:
        return vector
    vector = vector[:dimensions]
    return F.normalize(vector, dim=0) if normalize else vector


class Embedder:
    """Embeds token-id prompts with a model; call from the thread that owns the model's torch work."""

    def __init__(self, model: nn.Module, pooling: PoolingConfig, device: torch.device, max_batch_tokens: int) -> None:
        self.model = model
        self.pooling = pooling
        self.device = device
        self.max_batch_tokens = max_batch_tokens
        self._cache = DiscardKV()

    @torch.inference_mode()
    def embed(self, prompts: list[list[int]], dimensions: list[int] | None = None) -> list[torch.Tensor]:
        """One float32 CPU vector per prompt (in order), pooled, normalized where the checkpoint
        says so, then shortened to `dimensions[i]` (checked by `PoolingConfig.check_dimensions`)."""
        out: list[torch.Tensor] = []
        for batch in _batches(prompts, self.max_batch_tokens):
            out.extend(self._forward(batch))
        if dimensions is not None:
            out = [shorten(v, d, self.pooling.normalize) for v, d in zip(out, dimensions)]
        return out

    def _forward(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)  # (T,)
        positions = torch.cat([torch.arange(len(p)) for p in prompts]).to(self.device)  # (T,)
        no_table = torch.zeros(0, dtype=torch.long, device=self.device)
        meta = AttnMetadata(slot_mapping=torch.zeros(len(tokens), dtype=torch.long, device=self.device))
        start = 0
        for p in prompts:
            meta.prefills.append(PrefillChunk(start, len(p), len(p), no_table))
            start += len(p)
        hidden = self.model(tokens, positions, meta, self._cache)  # (T, d_model)
        vectors, start = [], 0
        for p in prompts:
            v = pool(hidden[start:start + len(p)], self.pooling.mode)
            vectors.append((F.normalize(v, dim=0) if self.pooling.normalize else v).cpu())
            start += len(p)
        return vectors


def _batches(prompts: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """Consecutive groups of at most `max_tokens` tokens (a longer prompt runs alone)."""
    groups: list[list[list[int]]] = []
    size = 0
    for p in prompts:
        if not groups or size + len(p) > max_tokens:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += len(p)
    return groups
