"""What one step's flat batch needs from its sequences' images: the encoder's embeddings for the
placeholder rows it prefills, and (M-RoPE) every row's three positions. The encoder runs here,
inside the step that first prefills an image's tokens (so in the chunked-prefill budget, never in
a decode-only step), and only for images whose outputs the cache does not hold."""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.engine.scheduler import ScheduledSeq
from model.multimodal.encoder_cache import EncoderCache


def image_embeds(spans: list[tuple[ScheduledSeq, int]], cache: EncoderCache,
                 encode: Callable[[dict[str, torch.Tensor]], torch.Tensor], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(flat rows (N,), embeddings (N, d_model)) of the image tokens this step computes; None: none."""
    rows: list[torch.Tensor] = []
    embeds: list[torch.Tensor] = []
    for s, first in spans:
        if s.seq.mm is None:
            continue
        start = s.seq.num_computed_tokens
        stop = start + s.num_new_tokens
        for image in s.seq.mm.images:
            lo, hi = max(start, image.offset), min(stop, image.end)
            if lo >= hi:
                continue
            out = cache.get(image, encode)  # (length, d_model)
            embeds.append(out[lo - image.offset:hi - image.offset])
            rows.append(torch.arange(first + lo - start, first + hi - start))
    if not rows:
        return None
    return torch.cat(rows).to(device), torch.cat(embeds)


def mrope_positions(spans: list[tuple[ScheduledSeq, int]], num_rows: int, device: torch.device) -> torch.Tensor | None:
    """(3, num_rows) M-RoPE positions of the flat batch, when a sequence in it has images (a text
    sequence's rows are its positions on all three axes); None when none has."""
    if not any(s.seq.mm is not None for s, _ in spans):
        return None
    out = torch.empty(3, num_rows, dtype=torch.long)
    for s, first in spans:
        start, n, mm = s.seq.num_computed_tokens, s.num_new_tokens, s.seq.mm
        if mm is None or mm.positions is None:
            out[:, first:first + n] = torch.arange(start, start + n)
            continue
        prompt = mm.positions.shape[1]
        k = max(0, min(start + n, prompt) - start)  # rows of this span inside the prompt
        if k:
            out[:, first:first + k] = mm.prompt_positions(start, start + k)
        out[:, first + k:first + n] = torch.arange(start + k, start + n) + mm.rope_delta
    return out.to(device)
