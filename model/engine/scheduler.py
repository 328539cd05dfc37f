"""Iteration-level scheduling (continuous batching with chunked prefill). No torch.

Each step: every running sequence gets its next tokens (one for a decoding sequence, a
chunk for one still prefilling) under a token budget; then waiting sequences are admitted
while budget, sequence slots and KV blocks last. When blocks run out, the newest running
sequence is preempted: its blocks are freed and it is recomputed later from its tokens.
With prefix caching a sequence is admitted with the longest run of cached full blocks that
matches its tokens and computes only the rest (see block_manager.py).

Sliding windows (`window`: set when every layer is windowed, the widest window): before a
running sequence's next tokens are scheduled, its leading blocks that no query from its next
position on can see are given back (BlockManager.release_out_of_window), so a long generation
holds about window / block_size blocks, not its whole length.

Dynamic NTK and LongRoPE (`rope_long_from`: the original context): a sequence longer than it on
arrival is rotated at every position as HF's prefill of it is (`Sequence.rope_len`, which also
salts its block hashes): with the frequencies of its own length (`rope_per_length`, dynamic NTK)
or LongRoPE's long factors; with `rope_recompute` (HF Phi-3's generate) a sequence that grows
past it drops its K/V and is recomputed long from position 0 in the same step, as HF drops its
cache there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from model.engine.block_manager import BlockManager
from model.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    """`seq` computes `num_new_tokens` tokens, from position `seq.num_computed_tokens`, this step."""

    seq: Sequence
    num_new_tokens: int
    # Speculative decoding: proposals verified after the last token (num_new_tokens is then
    # 1 + len(spec)); the engine samples such a sequence itself, so `samples` is False for it.
    spec: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting queue, the running batch and the block manager."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 recompute_all: bool = False, rope_long_from: int | None = None, rope_recompute: bool = False,
                 rope_per_length: bool = False, window: int | None = None) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # With no KV cache every step recomputes each sequence from position 0 (benchmarks only).
        self.recompute_all = recompute_all
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.rope_long_from = rope_long_from
        self.rope_recompute = rope_recompute and rope_long_from is not None
        self.rope_per_length = rope_per_length
        self.num_rope_recomputes = 0
        self.window = None if recompute_all else window

    def add(self, seq: Sequence) -> None:
        if self.rope_long_from is not None and seq.num_tokens > self.rope_long_from:
            # Dynamic NTK: the frequencies of this length; LongRoPE: one regime (and one salt, so
            # their blocks are shared) for every sequence longer than the original context.
            seq.rope_len = seq.num_tokens if self.rope_per_length else self.rope_long_from + 1
        self.waiting.append(seq)

    def tokens_before_recompute(self, seq: Sequence) -> int | None:
        """How many tokens `seq` can grow by before its LongRoPE recompute (None: it never
        recomputes): speculative proposals stay within it, so that none is verified against
        K/V of the short regime that HF computes in the long one."""
        if not self.rope_recompute or seq.rope_len:
            return None
        return self.rope_long_from - seq.num_tokens

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        if self.window is not None:  # first, so no sequence is preempted for blocks another gives back
            for seq in self.running:  # keys before this are out of every query's window from now on
                self.blocks.release_out_of_window(seq, seq.num_computed_tokens - self.window + 1)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.rope_recompute and not seq.rope_len and seq.num_tokens > self.rope_long_from:
                self._recompute_long(seq)  # re-admitted this step, at the head of the queue
                continue
            if self.recompute_all:
                seq.num_computed_tokens = 0
            n = min(seq.num_uncomputed_tokens, budget)
            spec, seq.spec_token_ids = seq.spec_token_ids, []
            if spec and self._schedule_spec(seq, spec, budget, out, len(self.running) - i - 1):
                budget -= 1 + len(spec)
                i += 1
                continue
            while not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SeqStatus.RUNNING:
                break  # seq preempted itself: everything after it is gone too
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        return budget

    def _schedule_spec(self, seq: Sequence, spec: list[int], budget: int, out: SchedulerOutput, after: int) -> bool:
        """Schedule a decoding `seq` with its proposals when budget and free blocks allow, leaving
        a block for each of the `after` running sequences behind it (proposals never cause a
        preemption); False: it decodes as usual."""
        n = 1 + len(spec)
        if seq.num_uncomputed_tokens != 1 or n > budget:
            return False
        if self.blocks.blocks_needed(seq, seq.num_computed_tokens + n) > self.blocks.num_free - after:
            return False
        self.blocks.grow(seq, seq.num_computed_tokens + n)
        out.scheduled.append(ScheduledSeq(seq, n, spec))
        return True

    def verified(self, seq: Sequence, num_accepted: int) -> None:
        """After verifying a speculating `seq` (its accepted tokens already in output_token_ids):
        the K/V of its last token and the `num_accepted` proposals kept are computed, the rest
        are discarded. Only those are committed (hashed), and blocks beyond what the next token
        needs are given back."""
        seq.num_computed_tokens += 1 + num_accepted
        self.blocks.shrink(seq, seq.num_tokens)
        self.blocks.commit(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.blocks.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _recompute_long(self, seq: Sequence) -> None:
        """`seq` crossed the original context: drop its short-regime K/V (their committed blocks
        stay cached for sequences of that regime) and queue it first, to be computed long."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.rope_len, seq.block_hashes = self.rope_long_from + 1, []
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1  # not a first admission: its cached-token count stays
        self.num_rope_recomputes += 1
        self.waiting.appendleft(seq)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        writing: set[bytes] | None = None
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            # Prompt logprobs need every prompt position computed: no cached prefix for them.
            matched = [] if seq.params.prompt_logprobs is not None else self.blocks.match(seq)
            if self.blocks.enable_prefix_caching:
                writing = self._being_written() if writing is None else writing
                if self.blocks.first_uncached_hash(seq, len(matched)) in writing:
                    # Another sequence (an n > 1 sibling, say) is computing this prefix right
                    # now: wait and share its blocks rather than compute them a second time.
                    i += 1
                    continue
            computed = len(matched) * self.blocks.block_size
            n = min(seq.num_tokens - computed, budget)
            if not self.blocks.can_admit(seq, matched, computed + n):
                break  # first come, first served: do not let later requests jump ahead
            del self.waiting[i]
            first = seq.num_preemptions == 0
            self.blocks.take(seq, matched, count=first)
            if first:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.blocks.grow(seq, computed + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            if writing is not None:
                writing.update(self.blocks.hashes(seq)[len(matched):])

    def _being_written(self) -> set[bytes]:
        """Hashes of the full blocks that running sequences hold but have not computed yet."""
        return {h for seq in self.running for h in self.blocks.hashes(seq)[seq.num_committed_blocks:]}

    def computed(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens are in the cache; their full blocks
        become shareable."""
        for s in out.scheduled:
            if s.spec:
                continue  # the engine calls verified() once it knows how many were accepted
            s.seq.num_computed_tokens += s.num_new_tokens
            self.blocks.commit(s.seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of the scheduler (finished or aborted) and free its blocks."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason


