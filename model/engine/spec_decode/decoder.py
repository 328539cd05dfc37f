"""What the engine calls: proposals before scheduling, verification after the forward pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model.config.speculative import SpeculativeConfig
from model.engine.sequence import Sequence, TokenLogprob
from model.engine.spec_decode import ngram
from model.engine.spec_decode.rejection import greedy_accept, rejection_sample
from model.sampling.sampler import SamplingRow, process_logits, sampling_probs, token_logprobs


@dataclass
class SpecStats:
    """Totals since start: proposals verified, of them accepted, and accepted at each position."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, draft=None) -> None:
        self.config = config
        self.draft = draft  # DraftProposer for method draft_model
        self.stats = SpecStats()
        self.stats.accepted_per_position = [0] * config.num_speculative_tokens
        self.stats.drafts_per_position = [0] * config.num_speculative_tokens
        self._q: dict[str, torch.Tensor | None] = {}

    def propose(self, seqs: list[tuple[Sequence, int, torch.Generator | None]]) -> None:
        """(decoding sequence, the most proposals it may take, its request's generator) ->
        seq.spec_token_ids set."""
        c = self.config
        want = [(s, min(k, c.num_speculative_tokens), g) for s, k, g in seqs if k >= 1]
        self._q = {}
        if c.method == "ngram":
            for s, k, _g in want:
                s.spec_token_ids = ngram.propose(s.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
            return
        got = self.draft.propose(want)
        for s, _k, _g in want:
            if s.request_id in got:
                s.spec_token_ids, self._q[s.request_id] = got[s.request_id]

    def release(self, request_id: str) -> None:
        if self.draft is not None:
            self.draft.release(request_id)

    def verify(self, entries: list[tuple[Sequence, list[int], torch.Tensor, torch.Generator | None]],
               row_of: Callable[[Sequence, list[int]], SamplingRow]) -> list[tuple[list[int], list[TokenLogprob | None]]]:
        """(sequence, proposals, target logits (1 + k, V), generator) -> per entry the tokens to
        emit and their logprobs. Position j is processed exactly as the plain sampler would the
        step after proposals[:j] were sampled (`row_of(seq, proposals[:j])`)."""
        rows, spans = [], []
        for seq, spec, _logits, _gen in entries:
            spans.append(len(rows))
            rows.extend(row_of(seq, spec[:j]) for j in range(len(spec) + 1))
        logits = process_logits(torch.cat([e[2] for e in entries]), rows)  # (sum(1 + k), V)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        probs = sampling_probs(logits, rows, rand) if rand else None
        where = {i: j for j, i in enumerate(rand)}
        argmax = logits.argmax(dim=-1).tolist()
        out = []
        for (seq, spec, _l, gen), lo in zip(entries, spans):
            n = len(spec) + 1
            if rows[lo].params.greedy:
                toks = greedy_accept(argmax[lo:lo + n], spec)
            else:
                p = probs[where[lo]:where[lo] + n]
                toks = rejection_sample(p, spec, self._q.get(seq.request_id), gen)
            accepted = len(toks) - 1
            st = self.stats
            st.num_draft_tokens += len(spec)
            st.num_accepted_tokens += accepted
            for j in range(len(spec)):
                st.drafts_per_position[j] += 1
                st.accepted_per_position[j] += j < accepted
            lps: list[TokenLogprob | None] = [None] * len(toks)
            if seq.params.logprobs is not None:
                lps = token_logprobs(logits[lo:lo + len(toks)], rows[lo:lo + len(toks)], toks)
            out.append((toks, lps))
        return out
