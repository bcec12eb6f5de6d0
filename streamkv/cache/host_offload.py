"""The cache manager's host-tier half: offloading session pins, restoring them, the step's transfers.

A mixin of :class:`streamkv.cache.kv_cache_manager.KVCacheManager` (split
out to keep that module small); it reads the manager's pool, pins, host
tier and pending copies, declared below. See :mod:`streamkv.cache.host_tier`
for the policy and :class:`streamkv.sched.output.SchedulerOutput` for the
order the runner applies the copies in.

What a transfer costs. On CUDA the runner issues the swaps on a side stream
that the forward waits for. On the CPU there is nothing to overlap with: the
copies run on the engine thread at the start of the step, and every
sequence of that step waits for them. They stay synchronous because they
are cheap next to what they save: a 60-block SmolLM2-135M fp32 session
(42 MiB) moves in 9-20 ms on this 2-core box (loaded; see
:mod:`streamkv.cache.block_copy`), where recomputing its ~960-token history
takes seconds (~400 prefill tokens/s). The slow part of a disk restore, the
file read and its CRC-32, runs off the engine thread
(:mod:`streamkv.cache.offload`).
"""

from __future__ import annotations

from streamkv.cache.block import CacheSeq, KVBlock, cdiv
from streamkv.cache.block_pool import BlockPool
from streamkv.cache.cache_stats import OffloadStats
from streamkv.cache.host_tier import HostSession, HostTier, SpillJob
from streamkv.cache.session_pins import SessionPins
from streamkv.cache.swap_space import SwapSpace


class HostOffloadMixin:
    """Session offload to the host tier and restore (mixed into ``KVCacheManager``)."""

    block_size: int
    pool: BlockPool
    host: SwapSpace
    host_sessions: HostTier
    sessions: SessionPins
    seq_blocks: dict[int, list[KVBlock]]
    offload_sessions: bool
    _swap_out: list[tuple[int, int]]
    _swap_in: list[tuple[int, int]]
    _pending_copies: list[tuple[int, int]]

    def release_session(self, session_id: str) -> bool:
        raise NotImplementedError  # KVCacheManager's

    def is_offloaded(self, session_id: str) -> bool:
        """The session's KV lives in the host tier (its next turn restores it)."""
        return session_id in self.host_sessions

    def is_loading(self, session_id: str | None) -> bool:
        """The session's KV is on its way from disk to the host tier (its turn waits; see ``SessionOffload``)."""
        return session_id in self.host_sessions.loading

    def restore_session(
        self, session_id: str, seq: CacheSeq, max_new_tokens: int, num_reserved_blocks: int = 0
    ) -> int | None:
        """Bring a host-resident session's KV back into fresh blocks for ``seq``, all or nothing.

        Reuses the longest common prefix of the host tokens and the prompt
        (capped so the last prompt token is computed); allocates blocks for
        it plus ``min(rest, max_new_tokens)`` new tokens and records the
        host -> device copies. Returns the tokens now computed (0: nothing
        reusable, the host copy is dropped), or ``None`` when the pool lacks
        the blocks (nothing changes; the host copy stays).
        """
        host = self.host_sessions.get(session_id)
        if host is None or seq.seq_id in self.seq_blocks:
            return 0
        limit = min(len(host.token_ids), len(seq.token_ids) - 1)
        n = next((i for i in range(limit) if host.token_ids[i] != seq.token_ids[i]), limit)
        if n == 0:
            self.host_sessions.drop(session_id)
            return 0
        new = min(len(seq.token_ids) - n, max_new_tokens)
        if cdiv(n + new, self.block_size) > self.pool.num_free_blocks - num_reserved_blocks:
            return None
        self.host_sessions.remove(session_id)
        keep = cdiv(n, self.block_size)
        blocks = self.pool.allocate(keep)
        self._swap_in.extend(zip(host.host_block_ids[:keep], (b.block_id for b in blocks), strict=True))
        self._release_swap_in_source(host.host_block_ids)
        self.seq_blocks[seq.seq_id] = blocks
        c = self.host_sessions.counters
        c.restored_sessions += 1
        c.restored_blocks += keep
        return n

    def admit_host_session(self, session_id: str, token_ids: list[int], history_tail: list[int]) -> list[int] | None:
        """Host blocks for a session coming back from disk (most recent); ``None`` if the tier cannot hold it.

        The caller writes the KV into the returned host blocks before the
        next step (no copy of the step in flight touches them).
        """
        self.release_session(session_id)
        ids = self.host_sessions.allocate(cdiv(len(token_ids), self.block_size))
        if ids is not None:
            self.host_sessions.add(HostSession(session_id, token_ids, history_tail, ids), copy_pending=False)
        return ids

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[SpillJob]]:
        """The step's ``(swap_out, swap_in, spills)``, in decision order; ends the step's host window.

        ``swap_out`` holds ``(device_block, host_block)`` copies (preemption
        by swap and session offload), ``swap_in`` ``(host_block,
        device_block)`` ones (swapped sequences and restored sessions).
        """
        out, self._swap_out = self._swap_out, []
        into, self._swap_in = self._swap_in, []
        spills = self.host_sessions.take_spills()
        self.host_sessions.end_window()
        return out, into, spills

    def _release_swap_in_source(self, host_ids: list[int]) -> None:
        # With offload, a session may be offloaded into these host blocks later in
        # this step, and the runner applies device -> host copies first: hold them
        # until the step's copies are sealed. Without offload no device -> host copy
        # is decided after a swap-in in one step (no swap-in in a step that preempted).
        if self.offload_sessions:
            self.host.free_later(host_ids)
        else:
            self.host.free(host_ids)

    def _offload(self, session_id: str) -> bool:
        pin = self.sessions[session_id]
        host_ids = self.host_sessions.allocate(len(pin.blocks))
        if host_ids is None:
            self.host_sessions.counters.dropped_sessions += 1
            return False
        cow_src = {dst: src for src, dst in self._pending_copies}
        self._swap_out.extend(
            (cow_src.get(b.block_id, b.block_id), h) for b, h in zip(pin.blocks, host_ids, strict=True)
        )
        session = HostSession(session_id, pin.token_ids, pin.history_tail, host_ids)
        self.host_sessions.add(session, copy_pending=True)
        c = self.host_sessions.counters
        c.offloaded_sessions += 1
        c.offloaded_blocks += len(host_ids)
        return True

    def offload_stats(self, block_bytes: int = 0) -> OffloadStats:
        """The host tier's gauges and counters (bytes at ``block_bytes`` per block); no disk fields."""
        h = self.host_sessions
        c = h.counters
        return OffloadStats(
            host_sessions=len(h.sessions),
            host_blocks=h.num_blocks,
            offloaded_sessions=c.offloaded_sessions,
            offloaded_blocks=c.offloaded_blocks,
            offloaded_bytes=c.offloaded_blocks * block_bytes,
            restored_sessions=c.restored_sessions,
            restored_blocks=c.restored_blocks,
            restored_bytes=c.restored_blocks * block_bytes,
            spilled_sessions=c.spilled_sessions,
            spilled_blocks=c.spilled_blocks,
            dropped_sessions=c.dropped_sessions,
        )
