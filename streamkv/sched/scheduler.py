"""Iteration-level scheduling (Orca) with chunked prefill under a token budget (vLLM).

Each step takes at most ``max_num_batched_tokens`` tokens from at most
``max_num_seqs`` sequences, in this order:

1. running sequences that decode (one token each), oldest first;
2. running sequences part-way through their prefill, oldest first;
3. swapped sequences, swapped back in oldest first;
4. waiting sequences, in arrival order (preempted ones at the front); a
   turn whose session's KV is still being read from disk is passed over
   until the read lands (a reader thread, bounded by the file's size; a
   failed read leaves the turn to recompute).

A sequence takes ``min(tokens left to compute, budget left)``. When the
pool cannot give a running sequence its slots, idle sessions are unpinned
first (offloaded to the host tier when session offload is on); then a
running sequence is preempted (recompute: blocks freed, requeued at the
front; swap: blocks copied to the host tier), until the sequence fits or
is itself the victim. The victim is the newest running sequence that is
not re-prefilling after a preemption (then the newest of those), never a
*protected* one. Waiting sequences never preempt anybody, and nothing is
admitted in a step that preempted.

Admission is all or nothing (vLLM v1): a waiting sequence adopts its
session's pin or references its prefix hits only together with the blocks
for this step's new tokens. When those are not free it holds nothing: the
adopted blocks go back to the pin (or are released with the pin when the
scheduler unpins for room), and the sequence waits at the head.

Progress. With ``P = max_preemptions``:

- *Bound*: a sequence is preempted at most ``P`` times. From its ``P``-th
  preemption on it is protected: never chosen as a victim, resumed (from
  waiting or swapped) only when the free blocks cover its whole remaining
  need (``ceil((prompt + max_tokens) / block_size)``) beyond the
  reservations of the protected sequences already running, and while it
  runs its missing blocks stay reserved: every other allocation leaves
  them free. So a protected sequence's allocation always succeeds, and it
  is never preempted. Each sequence computes at most ``(P + 1)`` times its
  tokens (recompute), and the number of preemptions is at most ``P`` per
  sequence.
- *No wedge*: a waiting sequence holds no blocks, and a swapped one only
  host blocks. When nothing runs, no reservation exists and every device
  block is free, cached or pinned; pins are released for room, so the head
  of ``swapped`` (or of ``waiting``) fits: admission validated that
  ``prompt + max_tokens`` fits the pool.
- *Every step progresses*: with a running sequence, the first one in the
  order above either gets its tokens or preempts somebody (itself
  included); with none running, the head of ``swapped`` is swapped in or
  the head of ``waiting`` admitted with at least one token. So a step
  computes a token or preempts, but for a step whose only work is a
  swap-in, and the next step then does. Preemptions are at most ``P`` per
  sequence and tokens computed at most ``(P + 1) * (prompt + max_tokens)``
  per sequence, so ``n`` sequences finish within
  ``2 * ((P + 1) * sum(prompt + max_tokens) + P * n) + 1`` steps with work
  (``tests/sched/test_random_scheduler.py`` asserts each term).
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from streamkv.cache.block import KVBlock
from streamkv.cache.kv_cache_manager import KVCacheManager, cdiv
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
        # the running ones preempted max_preemptions times (fixed while they run: only preemption counts)
        self._protected_running: list[Sequence] = []
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
        if self._protected(seq):
            self._protected_running.append(seq)

    def fork(self, parent: Sequence, seq_ids: Iterable[int]) -> list[Sequence]:
        """Fork ``parent`` into one child per id (parallel sampling, n > 1; beam search).

        Children get sample indices after the request's last one, share every
        block of ``parent`` (copy-on-write on the first write into a shared
        block), and join the running set; the request is marked forked. A
        parent that holds no device blocks (a beam preempted while it waited
        for its siblings) has children that wait at the front and recompute.
        """
        req = parent.request
        shares = self.kv.has_blocks(parent.seq_id)
        children = []
        for seq_id in seq_ids:
            child = Sequence(
                seq_id=seq_id,
                request=req,
                index=len(req.seqs),
                token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens,
                num_computed_tokens=parent.num_computed_tokens if shares else 0,
            )
            req.seqs.append(child)
            if shares:
                self.kv.fork(parent, child)
                self.add_running(child)
            else:
                self.waiting.appendleft(child)
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

    def finish(self, seq: Sequence, status: SeqStatus, pin: bool | None = None) -> None:
        """End a sequence: drop it from its queue, pin or free its blocks.

        ``pin``: keep its blocks for its request's session; ``None`` pins
        sample 0 of a sampling request (beam search picks its beam itself).
        """
        if seq.status.finished:
            return
        if pin is None:
            pin = seq.index == 0 and not seq.request.params.beam_search
        if seq.status is SeqStatus.RUNNING:
            self._remove_running(seq)
        elif seq.status is SeqStatus.SWAPPED:
            self.swapped.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.set_status(status)
        session = seq.request.session_id
        if session is not None and pin and self.kv.has_blocks(seq.seq_id):
            self.kv.pin_session(session, seq)
        self.kv.free(seq.seq_id)

    def describe(self) -> str:
        """One line of queue and pool state, for logs (the watchdog's stall report)."""
        head = self.waiting[0] if self.waiting else None
        head_text = (
            "none"
            if head is None
            else f"seq {head.seq_id} ({head.num_tokens} tokens, {head.num_computed_tokens} computed, "
            f"{head.num_preemptions} preemptions)"
        )
        return (
            f"running {len(self.running)}, waiting {len(self.waiting)}, swapped {len(self.swapped)}; "
            f"free blocks {self.kv.num_free_blocks}/{self.kv.num_blocks}, "
            f"reserved {self._num_reserved_blocks()}, pinned {self.kv.num_pinned_blocks} "
            f"in {len(self.kv.sessions)} sessions; head of waiting: {head_text}"
        )

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
            if seq.num_computed_tokens == seq.num_tokens:
                continue  # a beam that has sampled, waiting for its siblings (beam_search.py)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self._allocate(seq, n):
                if self.kv.unpin_lru():
                    continue
                victim = self._pick_victim()
                if victim is None:  # only protected sequences run: cannot happen (see the module doc)
                    logger.warning("seq %d found no slots and no victim; it waits a step", seq.seq_id)
                    break
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
        out.swap_out, out.swap_in, out.spills = self.kv.take_transfers()
        return out

    def _swap_in(self, out: SchedulerOutput, chosen: dict[int, int], by_id: dict[int, Sequence], budget: int) -> int:
        while self.swapped and budget > 0 and len(chosen) < self.config.max_num_seqs:
            seq = self.swapped[0]
            if self._protected(seq):
                needed = self._max_blocks(seq)
            else:  # its blocks, and room for the next token (a full last block needs one more)
                needed = max(
                    self.kv.num_swapped_blocks(seq.seq_id), cdiv(seq.num_computed_tokens + 1, self.kv.block_size)
                )
            if needed > self.kv.num_free_blocks - self._num_reserved_blocks():
                if self.kv.unpin_lru():
                    continue
                break
            mapping = self.kv.swap_in(seq)  # the copies go out with take_transfers()
            assert mapping is not None
            self.swapped.pop(0)
            self.add_running(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n and self._allocate(seq, n):  # n == 0: a waiting beam (see schedule)
                chosen[seq.seq_id] = n
                by_id[seq.seq_id] = seq
                budget -= n
        return budget

    def _admit_waiting(self, chosen: dict[int, int], by_id: dict[int, Sequence], budget: int) -> None:
        while self.waiting and budget > 0 and len(chosen) < self.config.max_num_seqs:
            # a turn whose session KV is still being read from disk is passed over until it lands
            seq = next((s for s in self.waiting if not (s.index == 0 and self.kv.is_loading(s.request.session_id))),
                       None)  # fmt: skip
            if seq is None:
                return
            admitted = self._try_admit(seq, budget)
            if admitted is None:
                if self.kv.unpin_lru():
                    continue
                return  # head of line waits for room, holding nothing; it never preempts
            num_pinned, num_hit_tokens, n = admitted
            self.waiting.remove(seq)
            if seq.index == 0 and seq.num_preemptions == 0:
                seq.request.num_cached_tokens = num_pinned + num_hit_tokens
            # tokens reused from a session pin count as cache hits too: what users
            # (and the hit-rate panel) care about is prompt tokens not recomputed
            self.kv.record_prefix_query(seq.num_tokens, num_hit_tokens + num_pinned)
            seq.num_computed_tokens = num_pinned + num_hit_tokens
            self.add_running(seq)
            chosen[seq.seq_id] = n
            by_id[seq.seq_id] = seq
            budget -= n

    def _try_admit(self, seq: Sequence, budget: int) -> tuple[int, int, int] | None:
        """Take what a waiting ``seq`` needs this step, all or nothing.

        Returns ``(tokens from its session's pin, tokens from prefix hits,
        new tokens this step)``, its blocks allocated; or ``None``, holding
        nothing (an adopted pin is handed back to its session).
        """
        assert not self.kv.has_blocks(seq.seq_id), f"waiting seq {seq.seq_id} holds blocks"
        if self._protected(seq) and self._max_blocks(seq) > self.kv.num_free_blocks - self._num_reserved_blocks():
            return None
        session = seq.request.session_id if seq.index == 0 else None
        if session is not None and self.kv.is_offloaded(session):
            # its KV is in the host tier: restore it with this step's blocks, all or nothing
            restored = self.kv.restore_session(session, seq, budget, self._num_reserved_blocks(exclude=seq))
            if restored is None:
                return None
            seq.num_computed_tokens = restored
            n = min(seq.num_tokens - restored, budget)
            ok = self._allocate(seq, n)
            assert ok, "restore_session allocated this step's blocks"
            return restored, 0, n
        num_pinned = self.kv.adopt_session(session, seq) if session is not None else 0
        seq.num_computed_tokens = num_pinned
        hits = [] if num_pinned else self.kv.get_computed_blocks(seq)
        num_hit_tokens = len(hits) * self.kv.block_size
        n = min(seq.num_tokens - num_pinned - num_hit_tokens, budget)
        if self._allocate(seq, n, hits):
            return num_pinned, num_hit_tokens, n
        if num_pinned:
            assert session is not None
            self.kv.pin_session(session, seq)  # the blocks go back to the pin (its reusable prefix)
        seq.num_computed_tokens = 0
        return None

    # ------------------------------------------------------- progress rules

    def _protected(self, seq: Sequence) -> bool:
        """Preempted ``max_preemptions`` times: never a victim again (see the module doc)."""
        return seq.num_preemptions >= self.config.max_preemptions

    def _max_blocks(self, seq: Sequence) -> int:
        """Blocks ``seq`` holds when it finishes: prompt + max_tokens tokens."""
        return cdiv(seq.num_prompt_tokens + seq.request.max_tokens, self.kv.block_size)

    def _num_reserved_blocks(self, exclude: Sequence | None = None) -> int:
        """Free blocks the running protected sequences (but ``exclude``) may still need."""
        return sum(
            self.kv.num_missing_blocks(s, s.num_prompt_tokens + s.request.max_tokens)
            for s in self._protected_running
            if s is not exclude
        )

    def _allocate(self, seq: Sequence, n: int, hits: list[KVBlock] | None = None) -> bool:
        """``allocate_slots`` leaving the other protected sequences' reservations free."""
        return self.kv.allocate_slots(seq, n, hits or (), self._num_reserved_blocks(exclude=seq))

    def _pick_victim(self) -> Sequence | None:
        """The newest unprotected running sequence, sparing those re-prefilling after a preemption."""
        candidates = [s for s in self.running if not self._protected(s)]
        if not candidates:
            return None
        return max(candidates, key=lambda s: (not self._resuming(s), s.arrival))

    @staticmethod
    def _resuming(seq: Sequence) -> bool:
        """Re-prefilling after a preemption (its lost tokens are being recomputed)."""
        return seq.num_preemptions > 0 and seq.num_tokens - seq.num_computed_tokens > 1

    def _remove_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq in self._protected_running:
            self._protected_running.remove(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        assert not self._protected(seq), f"seq {seq.seq_id} is protected from preemption"
        self._remove_running(seq)
        seq.num_preemptions += 1
        out.num_preempted += 1
        swap = self.config.preemption_mode is PreemptionMode.SWAP
        if swap and seq.num_computed_tokens and self.kv.can_swap_out(seq.seq_id):
            self.kv.swap_out(seq)  # the copies go out with take_transfers()
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
            "preempted seq %d (request %s) by %s: pool dry, %d free blocks, preemption %d of at most %d",
            seq.seq_id,
            seq.request.request_id,
            mode,
            self.kv.num_free_blocks,
            seq.num_preemptions,
            self.config.max_preemptions,
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
