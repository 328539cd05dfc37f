"""The image encoder's outputs, kept by image hash so that an image is encoded once: across the
chunks of one prefill, a preempted request's recompute, and every request that sends it again."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from model.multimodal.inputs import ImageItem


class EncoderCache:
    """Least-recently-used encoder outputs, at most `capacity` embedding rows (tokens) in all; an
    output larger than the whole capacity is used once and not kept."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._rows = 0
        self.hits = 0
        self.misses = 0  # = images encoded
        self.encode_seconds = 0.0  # time spent encoding them

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, image: ImageItem, encode: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        """The image's embeddings (length, d_model): cached, or `encode(image.data)` now."""
        out = self._entries.get(image.hash)
        if out is not None:
            self._entries.move_to_end(image.hash)
            self.hits += 1
            return out
        start = time.perf_counter()
        out = encode(image.data)
        self.encode_seconds += time.perf_counter() - start
        self.misses += 1
        if out.shape[0] != image.length:
            raise RuntimeError(f"the encoder gave {out.shape[0]} embeddings for an image of {image.length} tokens")
        if out.shape[0] <= self.capacity:
            while self._rows + out.shape[0] > self.capacity:
                _, old = self._entries.popitem(last=False)
                self._rows -= old.shape[0]
            self._entries[image.hash] = out
            self._rows += out.shape[0]
        return out
