"""Iteration-level scheduling (Orca) with chunked prefill under a token budget (vLLM).

Each step takes at most ``max_num_batched_tokens`` tokens from at most
``max_num_seqs`` sequences, in this order:

1. running sequences that decode (one token each), oldest first;
2. running sequences part-way through their prefill, oldest first;
3. swapped sequences, swapped back in oldest first;
4. waiting sequences, in arrival order (preempted ones at the front).

A sequence takes ``min(tokens left to compute, budget left)``. When the
pool cannot give a running sequence its slots, idle sessions are unpinned
first; then the most recently arrived running sequence is preempted
(recompute: blocks freed, requeued at the front; swap: blocks copied to
the host tier), until the sequence fits or is itself the newest. Waiting
sequences never preempt anybody, and nothing is admitted in a step that
preempted.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from streamkv.cache.kv_cache_manager import KVCacheManager
from streamkv.config import PreemptionMode, SchedulerConfig
from streamkv.sched.output import ScheduledSeq, SchedulerOutput
from streamkv.sched.request import SeqStatus, Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerCounters:
    """Monotonic counters the scheduler keeps (mutable; engine thread only)."""

    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    computed_prompt_tokens: int = 0  # prompt tokens actually run through the model


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """What the scheduler reports each step (immutable; safe to read from any thread).

    Attributes:
        num_running: sequences in the running set.
        num_waiting: sequences waiting for admission (preempted ones included).
        num_swapped: sequences whose KV is in the host tier.
        preemptions_recompute: preemptions that freed blocks (monotonic).
        preemptions_swap: preemptions that swapped blocks out (monotonic).
        computed_prompt_tokens: prompt tokens run through the model (monotonic).
    """

    num_running: int
    num_waiting: int
    num_swapped: int
    preemptions_recompute: int
    preemptions_swap: int
    computed_prompt_tokens: int


class Scheduler:
    """Owns the waiting / running / swapped queues; never touches a tensor."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival
        self.swapped: list[Sequence] = []  # sorted by arrival
        self.counters = SchedulerCounters()

    # ------------------------------------------------------------ queues

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Insert an already computed sequence (a fork child) into the running set."""
        seq.set_status(SeqStatus.RUNNING)
        bisect.insort(self.running, seq, key=lambda s: s.arrival)

    def fork(self, parent: Sequence, seq_ids: Iterable[int]) -> list[Sequence]:
        """Fork ``parent`` into one running child per id (parallel sampling, n > 1).

        Children get sample indices after the request's last one, share every
        block of ``parent`` (copy-on-write on the first write into a shared
        block), and join the running set; the request is marked forked.
        """
        req = parent.request
        children = []
        for seq_id in seq_ids:
            child = Sequence(
                seq_id=seq_id,
                request=req,
                index=len(req.seqs),
                token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens,
                num_computed_tokens=parent.num_computed_tokens,
            )
            req.seqs.append(child)
            self.kv.fork(parent, child)
            self.add_running(child)
            children.append(child)
        req.forked = True
        return children

    def stats(self) -> SchedulerStats:
        """A copy of the queue lengths and counters for the stats snapshot."""
        c = self.counters
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            preemptions_recompute=c.preemptions_recompute,
            preemptions_swap=c.preemptions_swap,
            computed_prompt_tokens=c.computed_prompt_tokens,
        )

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def has_work(self) -> bool:
        return self.num_unfinished > 0

    def finish(self, seq: Sequence, status: SeqStatus) -> None:
        """End a sequence: drop it from its queue, pin or free its blocks."""
        if seq.status.finished:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.SWAPPED:
            self.swapped.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.set_status(status)
        session = seq.request.session_id
        if session is not None and seq.index == 0 and self.kv.has_blocks(seq.seq_id):
            self.kv.pin_session(session, seq)
        self.kv.free(seq.seq_id)

    # ----------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens; allocate their slots; preempt if the pool is dry."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chosen: dict[int, int] = {}  # seq id -> new tokens, in scheduling order
        by_id: dict[int, Sequence] = {}

        # 1 + 2: running decodes, then running partial prefills (oldest first)
        order = sorted(self.running, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1, s.arrival))
        for seq in order:
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0 or len(chosen) >= self.config.max_num_seqs:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, n):
                if self.kv.unpin_lru():
                    continue
                victim = self.running[-1]
                budget += chosen.pop(victim.seq_id, 0)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                chosen[seq.seq_id] = n
                by_id[seq.seq_id] = seq
                budget -= n

        if out.num_preempted == 0:
            budget = self._swap_in(out, chosen, by_id, budget)
        if out.num_preempted == 0 and not self.swapped:
            self._admit_waiting(chosen, by_id, budget)

        for seq_id, n in chosen.items():
            seq = by_id[seq_id]
            start = seq.num_computed_tokens
            out.scheduled.append(
                ScheduledSeq(
                    seq=seq,
                    token_ids=seq.token_ids[start : start + n],
                    start_pos=start,
                    block_table=self.kv.block_table(seq_id),
                    samples=start + n == seq.num_tokens,
                )
            )
        out.copies = self.kv.take_copies()
        return out

    def _swap_in(self, out: SchedulerOutput, chosen: dict[int, int], by_id: dict[int, Sequence], budget: int) -> int:
        while self.swapped and budget > 0 and len(chosen) < self.config.max_num_seqs:
            seq = self.swapped[0]
            if not self.kv.can_swap_in(seq.seq_id, num_extra_blocks=1):  # +1: room for the next token
                break
            mapping = self.kv.swap_in(seq)
            assert mapping is not None
            out.swap_in.extend(mapping)
            self.swapped.pop(0)
            self.add_running(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.kv.allocate_slots(seq, n):
                chosen[seq.seq_id] = n
                by_id[seq.seq_id] = seq
                budget -= n
        return budget

    def _admit_waiting(self, chosen: dict[int, int], by_id: dict[int, Sequence], budget: int) -> None:
        while self.waiting and budget > 0 and len(chosen) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = []
            pinned = 0
            fresh = not self.kv.has_blocks(seq.seq_id)
            if fresh and seq.request.session_id is not None and seq.index == 0:
                seq.num_computed_tokens = self.kv.adopt_session(seq.request.session_id, seq)
                fresh = seq.num_computed_tokens == 0
                pinned = seq.num_computed_tokens
            if fresh:
                hits = self.kv.get_computed_blocks(seq)
            num_hit_tokens = len(hits) * self.kv.block_size
            n = min(seq.num_tokens - seq.num_computed_tokens - num_hit_tokens, budget)
            while not self.kv.allocate_slots(seq, n, hits):
                if not self.kv.unpin_lru():
                    return  # head of line waits for room; it never preempts
            self.waiting.popleft()
            if seq.index == 0 and seq.num_preemptions == 0:
                seq.request.num_cached_tokens = seq.num_computed_tokens + num_hit_tokens
            if fresh or pinned:
                # tokens reused from a session pin count as cache hits too: what users
                # (and the hit-rate panel) care about is prompt tokens not recomputed
                self.kv.record_prefix_query(seq.num_tokens, num_hit_tokens + pinned)
            seq.num_computed_tokens += num_hit_tokens
            self.add_running(seq)
            chosen[seq.seq_id] = n
            by_id[seq.seq_id] = seq
            budget -= n

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        out.num_preempted += 1
        swap = self.config.preemption_mode is PreemptionMode.SWAP
        if swap and seq.num_computed_tokens and self.kv.can_swap_out(seq.seq_id):
            out.swap_out.extend(self.kv.swap_out(seq))
            seq.set_status(SeqStatus.SWAPPED)
            bisect.insort(self.swapped, seq, key=lambda s: s.arrival)
            self.counters.preemptions_swap += 1
            mode = PreemptionMode.SWAP
        else:
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.set_status(SeqStatus.WAITING)
            self.waiting.appendleft(seq)
            self.counters.preemptions_recompute += 1
            mode = PreemptionMode.RECOMPUTE
        logger.debug(
            "preempted seq %d (request %s) by %s: pool dry, %d free blocks",
            seq.seq_id,
            seq.request.request_id,
            mode,
            self.kv.num_free_blocks,
        )

    # ------------------------------------------------------------- update

    def update(self, out: SchedulerOutput) -> list[ScheduledSeq]:
        """Advance ``num_computed_tokens`` after the forward; return the entries that sample."""
        sampling = []
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens = s.start_pos + len(s.token_ids)
            p = seq.num_prompt_tokens
            self.counters.computed_prompt_tokens += min(seq.num_computed_tokens, p) - min(s.start_pos, p)
            self.kv.commit(seq)
            if s.samples:
                sampling.append(s)
        return sampling
