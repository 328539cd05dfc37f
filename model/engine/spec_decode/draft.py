"""Draft-model proposals: a small model of the target's vocabulary, with its own paged KV cache,
block manager and `ModelRunner` in the same engine. Each step it catches up on the tokens the
target accepted since its last pass (one chunk per sequence) and then proposes k tokens, all
speculating sequences batched in each of its k forward passes."""

from __future__ import annotations

import torch

from model.engine.kv.block_manager import BlockManager
from model.engine.runner import ModelRunner
from model.engine.scheduler import ScheduledSeq
from model.engine.sequence import Sequence
from model.layers.kv_cache import KVCache
from model.layers.linear.fuse import fuse_projections
from model.loading.loading import load_weights, resolve_model
from model.sampling.sampler import SamplingRow, sampling_probs


class DraftProposer:
    def __init__(self, model: str, target_vocab: int, target_eos: frozenset[int], num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, attention_backend: str = "auto") -> None:
        cfg, net, tokenizer, _ = load_weights(resolve_model(model, None), dtype, device)
        fuse_projections(net)
        if cfg.vocab_size != target_vocab:
            raise ValueError(f"speculative_config: draft model {model!r} has a vocabulary of {cfg.vocab_size} "
                             f"tokens, the target {target_vocab}; a draft must share the target's tokenizer")
        if frozenset(tokenizer.eos_token_ids) != target_eos:
            raise ValueError(f"speculative_config: draft model {model!r} has end-of-sequence ids "
                             f"{sorted(tokenizer.eos_token_ids)}, the target {sorted(target_eos)}")
        self.config = cfg
        cache = KVCache(cfg.n_layers, num_blocks, block_size, cfg.kv_heads, cfg.d_head, dtype, device)
        self.runner = ModelRunner(net, cache, device, attention_backend, enforce_eager=True)
        self.blocks = BlockManager(num_blocks, block_size)
        self._seqs: dict[str, Sequence] = {}  # the draft's copy of each sequence: its tokens and blocks
        self._base: dict[str, int] = {}  # tokens the target had at the draft's last proposal

    def release(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        self._base.pop(request_id, None)
        if seq is not None:
            self.blocks.free(seq)

    def _catch_up(self, target: Sequence, k: int) -> Sequence | None:
        """The draft sequence of `target`, its cache valid up to the tokens both still agree on,
        with blocks for k - 1 proposals more; None when the draft's pool has no room."""
        d = self._seqs.get(target.request_id)
        if d is None:
            d = self._seqs[target.request_id] = Sequence(target.request_id, [], target.params)
        toks = target.token_ids
        m = min(self._base.get(target.request_id, 0), len(d.prompt_token_ids))
        while m < min(len(d.prompt_token_ids), len(toks)) and d.prompt_token_ids[m] == toks[m]:
            m += 1
        d.num_computed_tokens = min(d.num_computed_tokens, m, len(toks) - 1)
        d.prompt_token_ids = toks
        self._base[target.request_id] = len(toks)
        if not self.blocks.can_grow(d, len(toks) + k - 1):
            self.release(target.request_id)
            return None
        self.blocks.grow(d, len(toks) + k - 1)
        return d

    @torch.inference_mode()
    def propose(self, targets: list[tuple[Sequence, int, torch.Generator | None]],
                ) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """(sequence, k, its request's generator: seeded requests draw from it) -> request id:
        (k proposals, the draft's distributions (k, V) they were drawn from, None for greedy)."""
        seqs, ks, gens, props, dists = [], [], [], [], []
        for target, k, gen in targets:
            d = self._catch_up(target, k)
            if d is not None:
                seqs.append(d), ks.append(k), gens.append(gen), props.append([]), dists.append([])
        for r in range(max(ks, default=0)):
            live = [i for i in range(len(seqs)) if ks[i] > r]
            batch = [ScheduledSeq(seqs[i], seqs[i].num_uncomputed_tokens) for i in live]
            tokens, positions, meta, idx = self.runner.prepare(batch)
            hidden = self.runner.model(tokens, positions, meta, self.runner.cache)
            logits = self.runner.model.compute_logits(hidden[idx]).float()  # (len(live), V)
            for s in batch:
                s.seq.num_computed_tokens += s.num_new_tokens
            rows = [SamplingRow(seqs[i].params, [], [], None, []) for i in live]
            rand = [j for j, row in enumerate(rows) if not row.params.greedy]
            picks = logits.argmax(dim=-1).tolist()
            if rand:
                q = sampling_probs(logits, rows, rand)
                for qi, j in enumerate(rand):
                    picks[j] = int(torch.multinomial(q[qi], 1, generator=gens[live[j]]))
                    dists[live[j]].append(q[qi])
            for j, i in enumerate(live):
                props[i].append(picks[j])
                seqs[i].prompt_token_ids = seqs[i].prompt_token_ids + [picks[j]]
        out = {}
        for d, p, q in zip(seqs, props, dists):
            out[d.request_id] = (p, torch.stack(q) if q else None)
        return out
