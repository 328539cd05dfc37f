"""Batched sampling: penalties, logit bias, temperature, top-k, top-p, per-request seeds and logprobs,
applied to the whole batch's logits at once.

Requests with a seed draw from their own `torch.Generator`, so the same seed gives the
same sample whatever else is in the batch. A row may carry logits processors (e.g. a
structured-output grammar mask): they change that row's logits in place before anything else;
rows without one pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model.sampling.logprobs import TokenLogprob
from model.sampling.params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence of the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # set when params.seed is set
    suppress_ids: list[int]  # e.g. eos while fewer than min_tokens have been generated
    # Each changes this row's logits (V,) in place, first of all (e.g. a grammar's token mask).
    logits_processors: list[Callable[[torch.Tensor], None]] = field(default_factory=list)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """OpenAI presence/frequency penalties over generated tokens; vLLM's repetition
    penalty over prompt and generated tokens. logits (B, V) float32, changed in place.

    Every tensor is made on the logits' device: torch mixes devices only for 0-dim CPU tensors."""
    vocab, device = logits.shape[1], logits.device
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long,
                                device=device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            ids = torch.tensor(row.output_token_ids, dtype=torch.long, device=device)
            # Occurrences of each token (V,); index_add_, unlike bincount, needs no host sync.
            counts = logits.new_zeros(vocab).index_add_(0, ids, logits.new_ones(ids.shape[0]))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """OpenAI's `logit_bias`: each row's {token id: bias} added to its logits (B, V), in place.
    Ids are in the vocabulary (model.request_checks)."""
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask out tokens outside each row's top-k and nucleus top-p. logits (B, V) already tempered."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
    # top-p applies to what top-k left, renormalised (as vLLM and HF transformers do).
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token while the mass before it is < top_p (the top token always stays). Rows with
    # top_p = 1 skip this: float32 cumsums reach 1.0 early and would cut a long tail.
    drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def _suppress(row_logits: torch.Tensor, row: SamplingRow) -> None:
    """Forbid `row.suppress_ids` (V,) in place, unless a logits processor left nothing else:
    a grammar whose structure is complete allows only eos, and it wins over min_tokens."""
    if not row.logits_processors:
        row_logits[row.suppress_ids] = float("-inf")
        return
    kept = row_logits[row.suppress_ids].clone()
    row_logits[row.suppress_ids] = float("-inf")
    if bool(torch.isneginf(row_logits).all()):
        row_logits[row.suppress_ids] = kept


def _sample_rows(probs: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    shared = [i for i in idx if rows[i].generator is None]
    if shared:
        picks = torch.multinomial(probs[shared], 1).view(-1).tolist()
        out.update(zip(shared, picks))
    for i in idx:
        if rows[i].generator is not None:
            out[i] = int(torch.multinomial(probs[i], 1, generator=rows[i].generator).item())
    return out


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits (B, V) -> float32 logits after each row's processors, penalties, bias and
    suppressed ids: what greedy argmax, temperature sampling and logprobs all start from
    (speculative verification reuses it, model/engine/spec_decode/)."""
    logits = logits.float()
    for i, r in enumerate(rows):
        for process in r.logits_processors:
            process(logits[i])
    if any(r.params.needs_penalties for r in rows):
        logits = apply_penalties(logits, rows)
    if any(r.params.logit_bias for r in rows):
        logits = apply_logit_bias(logits, rows)
    for i, r in enumerate(rows):
        if r.suppress_ids:
            _suppress(logits[i], r)
    return logits


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits (B, V) -> one token id per row, and its logprobs where the row asked for them."""
    logits = process_logits(logits, rows)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    tokens: dict[int, int] = {}
    if greedy:
        # argmax over every row reads the logits once; gathering the greedy rows first would copy them.
        best = logits.argmax(dim=-1).tolist()
        tokens.update((i, best[i]) for i in greedy)
    if random_rows:
        tokens.update(_sample_random(logits, rows, random_rows))
    token_list = [tokens[i] for i in range(len(rows))]
    return token_list, token_logprobs(logits, rows, token_list)


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> dict[int, int]:
    probs = sampling_probs(logits, rows, idx)
    local = _sample_rows(probs, [rows[i] for i in idx], list(range(len(idx))))
    return {idx[j]: tok for j, tok in local.items()}


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> torch.Tensor:
    """The distribution (len(idx), V) that rows `idx` (not greedy) sample from: processed logits
    (`process_logits`) over temperature, then top-k / top-p."""
    device = logits.device
    temperature = torch.tensor([rows[i].params.temperature for i in idx], dtype=logits.dtype, device=device)
    sub = logits[idx] / temperature[:, None]
    vocab = sub.shape[1]
    # A top_k beyond the vocabulary keeps everything (and must not overflow int64).
    ks = [min(rows[i].params.top_k, vocab) if rows[i].params.top_k > 0 else vocab for i in idx]
    ps = [rows[i].params.top_p for i in idx]
    if any(k < vocab for k in ks) or any(p < 1.0 for p in ps):  # decided on the host: no device sync
        top_k = torch.tensor(ks, dtype=torch.long, device=device)
        top_p = torch.tensor(ps, dtype=sub.dtype, device=device)
        sub = _top_k_top_p(sub, top_k, top_p)
    return torch.softmax(sub, dim=-1)


def token_logprobs(logits: torch.Tensor, rows: list[SamplingRow], tokens: list[int]) -> list[TokenLogprob | None]:
    """Each row's logprob of `tokens[i]` (and its top-N) from processed logits, where the row asks."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(rows)
    if not want:
        return out
    logp = torch.log_softmax(logits[want], dim=-1)  # (W, V), after penalties, before temperature
    for j, i in enumerate(want):
        n = rows[i].params.logprobs or 0
        top = torch.topk(logp[j], n) if n else None
        out[i] = TokenLogprob(
            token_id=tokens[i],
            logprob=float(logp[j, tokens[i]]),
            top=list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
        )
    return out


PROMPT_LOGPROB_ROWS = 256  # positions per log-softmax: (rows, vocab) float32 at a time, not the whole chunk


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprob]:
    """logits (P, V) at P prompt positions -> the logprob of each next prompt token `targets[i]`
    and the top `top_n` there. Raw model logprobs: no penalty, bias or temperature applies to a
    prompt."""
    out: list[TokenLogprob] = []
    for lo in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        logp = torch.log_softmax(logits[lo:lo + PROMPT_LOGPROB_ROWS].float(), dim=-1)  # (R, V)
        want = targets[lo:lo + PROMPT_LOGPROB_ROWS]
        picked = logp.gather(1, torch.tensor(want, device=logp.device)[:, None]).view(-1).tolist()
        top = torch.topk(logp, top_n) if top_n else None
        for r, (tok, lp) in enumerate(zip(want, picked)):
            alts = list(zip(top.indices[r].tolist(), top.values[r].tolist())) if top is not None else []
            out.append(TokenLogprob(tok, lp, alts))
    return out
