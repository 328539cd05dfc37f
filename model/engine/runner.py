"""Turns a scheduled batch into tensors, runs one forward pass, samples. Returns plain lists."""

from __future__ import annotations

import torch

from model.engine.scheduler import ScheduledSeq
from model.engine.sequence import TokenLogprob
from model.layers.kv_cache import AttnMetadata, KVCache, PrefillChunk
from model.layers.paged_attention import paged_decode_attention, paged_prefill_attention, use_fused
from model.models.transformer import Transformer
from model.sampling.sampler import SamplingRow, prompt_token_logprobs, sample


class ModelRunner:
    """Owns the model and its KV cache on one device."""

    def __init__(self, model: Transformer, cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.block_size = cache.block_size
        # Decode attention reads the paged cache in place through the fused kernel where it
        # builds (CPU); otherwise, and for additive attention, through the gather path.
        self.fused_available = use_fused(device)
        self.fused_decode = self.fused_available

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata, list[int]]:
        """Flatten the batch: decode tokens (one per sequence) first, then prefill chunks.

        Returns tokens (T,), positions (T,), metadata, and the flat index of the last token
        of each sequence that samples this step (in `batch` order).
        """
        decode, prefill = _split(batch)
        tokens: list[int] = []
        positions: list[int] = []
        where: dict[int, int] = {}  # id(ScheduledSeq) -> flat index of its last token
        for s in decode + prefill:
            start = s.seq.num_computed_tokens
            tokens.extend(s.seq.token_ids[start:start + s.num_new_tokens])
            positions.extend(range(start, start + s.num_new_tokens))
            where[id(s)] = len(tokens) - 1
        pos = torch.tensor(positions, dtype=torch.long)
        meta = AttnMetadata(slot_mapping=self._slots(decode + prefill, pos), num_decode=len(decode))
        if self.fused_decode:
            meta.prefill_kernel = paged_prefill_attention
        if decode:
            self._decode_meta(meta, decode)
        offset = len(decode)
        for s in prefill:
            ctx = s.seq.num_computed_tokens + s.num_new_tokens
            table = torch.tensor(s.seq.block_table, dtype=torch.long, device=self.device)
            meta.prefills.append(PrefillChunk(offset, s.num_new_tokens, ctx, table))
            offset += s.num_new_tokens
        sample_idx = [where[id(s)] for s in batch if s.samples]
        return torch.tensor(tokens, dtype=torch.long, device=self.device), pos.to(self.device), meta, sample_idx

    def _slots(self, seqs: list[ScheduledSeq], pos: torch.Tensor) -> torch.Tensor:
        """Flat cache row of each token: block_table[p // block_size] * block_size + p % block_size."""
        tables = [t for s in seqs for t in [s.seq.block_table] * s.num_new_tokens]
        blocks = torch.tensor([t[p] for t, p in zip(tables, (pos // self.block_size).tolist())], dtype=torch.long)
        return (blocks * self.block_size + pos % self.block_size).to(self.device)

    def _decode_meta(self, meta: AttnMetadata, decode: list[ScheduledSeq]) -> None:
        width = max(len(s.seq.block_table) for s in decode)
        tables = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in decode]
        lens = [s.seq.num_computed_tokens + 1 for s in decode]
        meta.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=self.device)  # (B, width)
        meta.decode_context_lens = torch.tensor(lens, dtype=torch.long, device=self.device)  # (B,)
        meta.decode_max_context = max(lens)
        if self.fused_decode:
            meta.decode_kernel = paged_decode_attention

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], rows: list[SamplingRow],
            prompt_logprobs: dict[str, list[TokenLogprob]] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
        """One forward pass over the batch; one sampled token per sequence that `samples`
        (`rows` gives their sampling state, in `batch` order).

        Sequences whose params ask for `prompt_logprobs` also get, in `prompt_logprobs[request_id]`,
        the logprobs of the prompt tokens this chunk's positions predict (in position order)."""
        tokens, positions, meta, sample_idx = self.prepare(batch)
        hidden = self.model(tokens, positions, meta, self.cache)  # (T, d_model)
        if prompt_logprobs is not None:
            self._prompt_logprobs(batch, hidden, prompt_logprobs)
        if not sample_idx:
            return [], []
        logits = self.model.compute_logits(hidden[sample_idx])  # (B_s, vocab)
        return sample(logits, rows)

    def _prompt_logprobs(self, batch: list[ScheduledSeq], hidden: torch.Tensor,
                         out: dict[str, list[TokenLogprob]]) -> None:
        decode, prefill = _split(batch)  # the flat layout prepare() built
        flat = 0
        for s in decode + prefill:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            stop = min(start + n, seq.num_prompt_tokens - 1)  # positions that predict a prompt token
            if seq.params.prompt_logprobs is not None and start < stop:
                logits = self.model.compute_logits(hidden[flat:flat + stop - start])  # (P, vocab)
                targets = seq.prompt_token_ids[start + 1:stop + 1]
                out[seq.request_id] = prompt_token_logprobs(logits, targets, seq.params.prompt_logprobs)
            flat += n


def _split(batch: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[ScheduledSeq]]:
    """Decode sequences (one new token each), then prefill chunks: the order of the flat batch."""
    return [s for s in batch if s.num_new_tokens == 1], [s for s in batch if s.num_new_tokens != 1]
