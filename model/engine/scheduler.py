"""Iteration-level scheduling (continuous batching with chunked prefill). No torch.

Each step: every running sequence gets its next tokens (one for a decoding sequence, a
chunk for one still prefilling) under a token budget; then waiting sequences are admitted
while budget, sequence slots and KV blocks last. When blocks run out, the newest running
sequence (by priority: the worst) is preempted: its blocks are freed and it is recomputed
later from its tokens. With prefix caching a sequence is admitted with the longest run of
cached full blocks that matches its tokens and computes only the rest (see block_manager.py).

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

Policies (vLLM's `scheduling_policy`): `fcfs` admits in arrival order (a preempted sequence
first). `priority` ranks by effective priority, `Sequence.priority` (lower first) less one for
every `priority_aging_s` since arrival, so a long-waiting request outranks new better ones; the
running batch is kept best first, so the preemption victim (the last) is the worst, and a waiting
sequence that does not fit preempts running ones of a strictly worse rank for itself. Under both,
waiting sequences whose tenant has fewer running sequences go first among equals (fcfs: among all,
when any sequence names a tenant); a tenant's next one is ranked after its previous one is admitted.
Admission stops at the first sequence in that order that cannot be admitted.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from model.config import SCHEDULING_POLICIES
from model.engine.kv.block_manager import BlockManager, blocks_for
from model.engine.sequence import LOWEST_PRIORITY, SeqStatus, Sequence


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
                 rope_per_length: bool = False, window: int | None = None, policy: str = "fcfs",
                 priority_aging_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 lowest_priority_max_seqs: int | None = None) -> None:
        """`policy`, `priority_aging_s`, `lowest_priority_max_seqs`: EngineConfig's;
        `clock`: what sequences' arrival times are read against (time.monotonic)."""
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}; got {policy!r}")
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
        self.by_priority = policy == "priority"
        self.priority_aging_s = priority_aging_s
        self.lowest_priority_max_seqs = lowest_priority_max_seqs
        self.clock = clock
        self._now = 0.0  # the clock at the start of this step: every rank of one step is read at it
        self._num_tenanted = 0  # sequences in the scheduler that name a tenant (none: fcfs is plain FIFO)

    def add(self, seq: Sequence) -> None:
        if self.rope_long_from is not None and seq.num_tokens > self.rope_long_from:
            # Dynamic NTK: the frequencies of this length; LongRoPE: one regime (and one salt, so
            # their blocks are shared) for every sequence longer than the original context.
            seq.rope_len = seq.num_tokens if self.rope_per_length else self.rope_long_from + 1
        self._num_tenanted += seq.tenant is not None
        self.waiting.append(seq)

    def effective_priority(self, seq: Sequence, now: float) -> int:
        """`seq.priority`, lowered (improved) by 1 for every `priority_aging_s` since it arrived."""
        if not self.priority_aging_s:
            return seq.priority
        return seq.priority - math.floor(max(0.0, now - seq.arrival_time) / self.priority_aging_s)

    def _rank(self, seq: Sequence) -> tuple[int, float]:
        """Priority policy: lower is better (admitted first, preempted last)."""
        return self.effective_priority(seq, self._now), seq.arrival_time

    def tokens_before_recompute(self, seq: Sequence) -> int | None:
        """How many tokens `seq` can grow by before its LongRoPE recompute (None: it never
        recomputes): speculative proposals stay within it, so that none is verified against
        K/V of the short regime that HF computes in the long one."""
        if not self.rope_recompute or seq.rope_len:
            return None
        return self.rope_long_from - seq.num_tokens

    def num_lowest(self) -> tuple[int, int]:
        """Running and waiting sequences at LOWEST_PRIORITY (the Batch API's), for metrics."""
        return (sum(s.priority == LOWEST_PRIORITY for s in self.running),
                sum(s.priority == LOWEST_PRIORITY for s in self.waiting))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.by_priority:
            self._now = self.clock()
            self.running.sort(key=self._rank)  # best first (stable: equals stay in admission order)
        lowest_room = self._lowest_room()
        budget = self._schedule_running(out, self.max_num_batched_tokens, lowest_room)
        if not out.preempted:
            self._admit_waiting(out, budget, lowest_room)
        return out

    def _lowest_room(self) -> list[int] | None:
        """How many sequences of the lowest priority this step may still take (a one-item list,
        counted down as they are scheduled); None: no limit (none set, or only such sequences in
        the scheduler: a batch alone uses the whole engine)."""
        cap = self.lowest_priority_max_seqs
        if cap is None:
            return None
        if all(s.priority == LOWEST_PRIORITY for s in self.running) and \
                all(s.priority == LOWEST_PRIORITY for s in self.waiting):
            return None
        return [cap]

    @staticmethod
    def _paused(seq: Sequence, lowest_room: list[int] | None) -> bool:
        """Whether `seq` sits this step out (a lowest-priority sequence past the step's limit);
        else it counts against the limit."""
        if lowest_room is None or seq.priority != LOWEST_PRIORITY:
            return False
        if lowest_room[0] <= 0:
            return True
        lowest_room[0] -= 1
        return False

    def _schedule_running(self, out: SchedulerOutput, budget: int, lowest_room: list[int] | None = None) -> int:
        if self.window is not None:  # first, so no sequence is preempted for blocks another gives back
            for seq in self.running:  # keys before this are out of every query's window from now on
                self.blocks.release_out_of_window(seq, seq.num_computed_tokens - self.window + 1)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._paused(seq, lowest_room):  # it keeps its blocks: nothing is recomputed when it goes on
                i += 1
                continue
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
                victim = self.running[-1]  # the newest; by priority, the worst (running is sorted best first)
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

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Free `seq`'s blocks and queue it to be recomputed; the tokens it had scheduled this step."""
        self.running.remove(seq)
        dropped = sum(s.num_new_tokens for s in out.scheduled if s.seq is seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.blocks.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        return dropped

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

    def _admit_waiting(self, out: SchedulerOutput, budget: int, lowest_room: list[int] | None = None) -> None:
        if not self.waiting or budget <= 0 or (not self.by_priority and len(self.running) >= self.max_num_seqs):
            return
        writing: set[bytes] | None = None
        load = None if self._fifo() else Counter(s.tenant for s in self.running)
        admitted: list[Sequence] = []
        for seq in self._waiting_order(load):
            if budget <= 0 or (not self.by_priority and len(self.running) >= self.max_num_seqs):
                break  # (before `match`, which may load blocks from a tier)
            if lowest_room is not None and seq.priority == LOWEST_PRIORITY and lowest_room[0] <= 0:
                continue  # past the step's limit of lowest-priority sequences: it waits, others may go
            # Prompt logprobs need every prompt position computed: no cached prefix for them.
            matched = [] if seq.params.prompt_logprobs is not None else self.blocks.match(seq)
            if self.blocks.enable_prefix_caching:
                writing = self._being_written() if writing is None else writing
                if self.blocks.first_uncached_hash(seq, len(matched)) in writing:
                    # Another sequence (an n > 1 sibling, say) is computing this prefix right
                    # now: wait and share its blocks rather than compute them a second time.
                    continue
            computed = len(matched) * self.blocks.block_size
            n = min(seq.num_tokens - computed, budget)
            freed = self._make_room(seq, matched, computed + n, out, load)
            if freed is None:
                break  # first come (or best ranked), first served: do not let later requests jump ahead
            budget += freed
            admitted.append(seq)
            self._paused(seq, lowest_room)  # counted against the limit (there was room: checked above)
            self._start(seq, matched, computed + n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            if load is not None:
                load[seq.tenant] += 1
            if writing is not None:
                writing.update(self.blocks.hashes(seq)[len(matched):])
        self._drop_waiting(admitted)

    def _start(self, seq: Sequence, matched: list[int], num_tokens: int) -> None:
        """Admit `seq` with the cached blocks `matched` and slots for its first `num_tokens` tokens."""
        first = seq.num_preemptions == 0
        self.blocks.take(seq, matched, count=first)
        if first:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.blocks.grow(seq, num_tokens)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def _make_room(self, seq: Sequence, matched: list[int], num_tokens: int, out: SchedulerOutput,
                   load: Counter | None) -> int | None:
        """None when `seq` cannot be admitted (a sequence slot, or blocks for `num_tokens` tokens
        past its cached `matched` ones, are missing). Under the priority policy, running sequences
        of a strictly worse effective priority are first preempted for it, the worst first, until
        it fits (none when preempting them all would not make it fit); then the tokens they had
        scheduled this step, which go back into the budget."""
        if self._fits(seq, matched, num_tokens):
            return 0
        if not self.by_priority:
            return None
        mine = self._rank(seq)[0]
        worse = [s for s in self.running if self._rank(s)[0] > mine]
        if not worse or not self._fits_without(worse, matched, num_tokens):
            return None
        freed = 0
        for victim in sorted(reversed(worse), key=self._rank, reverse=True):  # the newest of equals first
            freed += self._preempt(victim, out)
            if load is not None:
                load[victim.tenant] -= 1
            if self._fits(seq, matched, num_tokens):
                return freed
        return None

    def _fits(self, seq: Sequence, matched: list[int], num_tokens: int) -> bool:
        return len(self.running) < self.max_num_seqs and self.blocks.can_admit(seq, matched, num_tokens)

    def _fits_without(self, victims: list[Sequence], matched: list[int], num_tokens: int) -> bool:
        """Whether a sequence would fit (as `_fits`) once `victims` were preempted: the blocks only
        they hold would be free; a block of `matched` that nobody else holds is revived, not gained.
        (Every hold on this pool's blocks is a running sequence's.)"""
        if len(self.running) - len(victims) >= self.max_num_seqs:
            return False
        ids = {id(v) for v in victims}
        kept = {b for s in self.running if id(s) not in ids for b in s.block_table[s.num_released_blocks:]}
        freed = {b for v in victims for b in v.block_table[v.num_released_blocks:]} - kept
        reviving = sum(1 for b in matched if b not in kept)
        need = max(0, blocks_for(num_tokens, self.blocks.block_size) - len(matched))
        return need <= self.blocks.num_free + len(freed) - reviving

    def _fifo(self) -> bool:
        """Whether the waiting queue is served in its own order (fcfs, and no sequence names a tenant)."""
        return not self.by_priority and not self._num_tenanted

    def _waiting_order(self, load: Counter | None) -> Iterable[Sequence]:
        """The waiting sequences in the order they are offered admission: the queue's own under
        `_fifo` (`load` None); else by (effective priority (priority policy only), the tenant's
        running sequences in `load`, arrival (priority) or queue position (fcfs)). `load` is read
        as admission changes it: a tenant's next sequence is ranked once its previous one has been
        offered."""
        if load is None:
            return self.waiting  # not changed while admission iterates it: fcfs preempts nothing there
        return self._ranked(load)

    def _ranked(self, load: Counter) -> Iterable[Sequence]:
        # One heap per tenant of (rank without the load, sequence), and a heap of the tenants by
        # their best sequence's full rank: each pop costs log(tenants), nothing is sorted whole.
        queues: dict[str | None, list] = {}
        for pos, seq in enumerate(self.waiting):
            rank = self._rank(seq) if self.by_priority else (0, 0.0)
            queues.setdefault(seq.tenant, []).append((rank[0], rank[1], pos, seq))
        tenants = list(queues)
        heads = []
        for i, tenant in enumerate(tenants):
            heapq.heapify(queues[tenant])
            heads.append((*_with_load(queues[tenant][0], load[tenant]), i))
        heapq.heapify(heads)
        while heads:
            i = heapq.heappop(heads)[-1]
            queue = queues[tenants[i]]
            yield heapq.heappop(queue)[-1]
            if queue:
                heapq.heappush(heads, (*_with_load(queue[0], load[tenants[i]]), i))

    def _drop_waiting(self, admitted: list[Sequence]) -> None:
        """Take the admitted sequences out of the waiting queue (in FIFO order they lead it)."""
        ids = {id(s) for s in admitted}
        while ids and self.waiting and id(self.waiting[0]) in ids:
            ids.discard(id(self.waiting.popleft()))
        if ids:
            kept = [s for s in self.waiting if id(s) not in ids]
            self.waiting.clear()
            self.waiting.extend(kept)

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
        held = seq.status == SeqStatus.RUNNING or (seq.status == SeqStatus.WAITING and seq in self.waiting)
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif held:
            self.waiting.remove(seq)
        self._num_tenanted -= held and seq.tenant is not None
        self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason


def _with_load(entry: tuple, load: int) -> tuple:
    """A tenant queue's (priority, arrival, position, sequence) entry as its rank in the tenants'
    heap: (priority, the tenant's running sequences, arrival, position)."""
    return entry[0], load, entry[1], entry[2]
