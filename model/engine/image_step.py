"""What one step's flat batch needs from its sequences' images: the encoder's embeddings for the
placeholder rows it prefills, and (M-RoPE) every row's three positions. The encoder runs here,
inside the step that first prefills an image's tokens (so in the chunked-prefill budget, never in
a decode-only step), and only for images whose outputs the cache does not hold."""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.engine.scheduler import ScheduledSeq
from model.multimodal.encoder_cache import EncoderCache
from model.multimodal.inputs import MultiModalInputs

Encode = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def span_embeds(mm: MultiModalInputs, start: int, stop: int, cache: EncoderCache, encode: Encode
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The image rows among positions [start, stop) of one sequence (as offsets from `start`) and
    their embeddings, one pair of tensors per image they touch."""
    rows, embeds = [], []
    for image in mm.images:
        lo, hi = max(start, image.offset), min(stop, image.end)
        if lo < hi:
            out = cache.get(image, encode)  # (length, d_model)
            embeds.append(out[lo - image.offset:hi - image.offset])
            rows.append(torch.arange(lo - start, hi - start))
    return rows, embeds


def span_positions(mm: MultiModalInputs | None, start: int, stop: int) -> torch.Tensor:
    """(3, stop - start) M-RoPE positions of one sequence's positions [start, stop): the prompt's
    from its table, later tokens their index plus the prompt's delta on all three axes."""
    if mm is None or mm.positions is None:
        return torch.arange(start, stop).expand(3, -1)
    k = max(0, min(stop, mm.positions.shape[1]) - start)  # of them inside the prompt
    after = (torch.arange(start + k, stop) + mm.rope_delta).expand(3, -1)
    return torch.cat([mm.prompt_positions(start, start + k), after], dim=1)


def image_embeds(spans: list[tuple[ScheduledSeq, int]], cache: EncoderCache, encode: Encode, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(flat rows (N,), embeddings (N, d_model)) of the image tokens this step computes; None: none."""
    rows: list[torch.Tensor] = []
    embeds: list[torch.Tensor] = []
    for s, first in spans:
        if s.seq.mm is not None:
            start = s.seq.num_computed_tokens
            r, e = span_embeds(s.seq.mm, start, start + s.num_new_tokens, cache, encode)
            rows.extend(x + first for x in r)
            embeds.extend(e)
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
        start, n = s.seq.num_computed_tokens, s.num_new_tokens
        out[:, first:first + n] = span_positions(s.seq.mm, start, start + n)
    return out.to(device)
