"""Idle sessions offloaded off the device pool: their KV in host blocks, least recently used first.

When a session's pin has to give way (pool pressure or the pin budget), the
cache manager copies its blocks to host blocks of the swap space instead of
dropping them; the session's next turn copies them back (a swap-in) instead
of recomputing its history. When the host tier is full, the least recently
used host sessions move on to the disk tier (:class:`SpillJob`, written by
:mod:`streamkv.cache.disk_tier`) when one is configured, else they are
dropped (their full blocks may still hit in the device prefix cache).

This module knows block ids and token ids only; the runner copies tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from streamkv.cache.swap_space import SwapSpace


@dataclass(slots=True)
class HostSession:
    """An idle session whose KV lives in host blocks.

    Attributes:
        session_id: the session.
        token_ids: tokens whose KV the host blocks hold, in order.
        history_tail: the session's tokens after ``token_ids`` (the last
            sampled token, never computed); ``token_ids + history_tail`` is
            the conversation as the server holds it.
        host_block_ids: ``ceil(len(token_ids) / block_size)`` host block ids.
    """

    session_id: str
    token_ids: list[int]
    history_tail: list[int]
    host_block_ids: list[int]

    @property
    def history(self) -> list[int]:
        return self.token_ids + self.history_tail


@dataclass(slots=True)
class SpillJob:
    """A host session to write to disk: read its host blocks *before* this step's copies.

    Its host block ids are already free: a copy of the same step may write
    into them, so the runner (the engine core) reads them first. A session
    whose own device -> host copy rides on the same step is dropped instead.
    """

    session: HostSession


@dataclass(slots=True)
class OffloadCounters:
    """Monotonic offload counters (sessions and blocks); engine thread only."""

    offloaded_sessions: int = 0  # device -> host
    offloaded_blocks: int = 0
    restored_sessions: int = 0  # host -> device
    restored_blocks: int = 0
    spilled_sessions: int = 0  # host -> disk
    spilled_blocks: int = 0
    dropped_sessions: int = 0  # host full, no disk tier: KV forgotten


@dataclass(slots=True)
class HostTier:
    """Host-resident sessions over a :class:`SwapSpace`, LRU first.

    Args:
        space: the host block ids (shared with preemption by swap).
        spill_to_disk: evicted sessions become :class:`SpillJob` s (else dropped).
    """

    space: SwapSpace
    spill_to_disk: bool = False
    sessions: OrderedDict[str, HostSession] = field(default_factory=OrderedDict)
    num_blocks: int = 0  # host blocks held by sessions
    counters: OffloadCounters = field(default_factory=OffloadCounters)
    loading: set[str] = field(default_factory=set)  # sessions whose KV is being read from disk
    _spills: list[SpillJob] = field(default_factory=list)
    _fresh: set[str] = field(default_factory=set)  # offloaded this step: copy not applied yet

    def __contains__(self, session_id: object) -> bool:
        return session_id in self.sessions

    def get(self, session_id: str) -> HostSession | None:
        return self.sessions.get(session_id)

    def allocate(self, num_blocks: int, keep: str | None = None) -> list[int] | None:
        """Host block ids for a session of ``num_blocks`` blocks, evicting LRU sessions for room.

        ``keep``, and sessions whose device -> host copy is still pending, are
        never evicted. Returns ``None``, evicting nothing, when the free blocks
        plus those of the evictable sessions are too few (the rest is held by
        preempted sequences or waits for a pending copy). The returned blocks
        have no copy pending into them: the caller may write them at once.
        Evicted blocks are free at once: the runner reads spilled blocks
        before it applies any copy of the step (see :class:`SpillJob`).
        """
        space = self.space
        victims = [s for s in self.sessions if s != keep and s not in self._fresh]
        evictable = sum(len(self.sessions[s].host_block_ids) for s in victims)
        if num_blocks == 0 or space.num_free_blocks + evictable < num_blocks:
            return None
        for victim in victims:
            if space.num_free_blocks >= num_blocks:
                break
            self.evict(victim)
        return space.allocate(num_blocks)

    def add(self, session: HostSession, copy_pending: bool) -> None:
        """Register a session holding freshly allocated host blocks (most recent).

        ``copy_pending``: its device -> host copy rides on this step (an
        offload); until :meth:`end_window` it is not evicted, and its blocks
        are not reused this step if it is dropped.
        """
        self.sessions[session.session_id] = session
        self.num_blocks += len(session.host_block_ids)
        if copy_pending:
            self._fresh.add(session.session_id)

    def touch(self, session_id: str) -> None:
        """Mark a session most recently used."""
        if session_id in self.sessions:
            self.sessions.move_to_end(session_id)

    def least_recently_used(self) -> str | None:
        return next(iter(self.sessions), None)

    def remove(self, session_id: str) -> HostSession | None:
        """Forget a session; the caller releases its host blocks."""
        session = self.sessions.pop(session_id, None)
        if session is not None:
            self.num_blocks -= len(session.host_block_ids)
        return session

    def drop(self, session_id: str) -> bool:
        """Forget a session and release its blocks (the session is gone)."""
        session = self.remove(session_id)
        if session is None:
            return False
        if session_id in self._fresh:  # its device -> host copy is still pending: no reuse this step
            self.space.free_later(session.host_block_ids)
        else:
            self.space.free(session.host_block_ids)
        return True

    def evict(self, session_id: str) -> None:
        """Make room: spill the session to disk, or drop it; its blocks are free at once.

        Raises:
            ValueError: the session's device -> host copy is still pending.
        """
        if session_id in self._fresh:
            raise ValueError(f"session {session_id!r} was offloaded this step; it cannot be evicted yet")
        session = self.remove(session_id)
        assert session is not None
        self.space.free(session.host_block_ids)
        if self.spill_to_disk:
            self._spills.append(SpillJob(session))
            self.counters.spilled_sessions += 1
            self.counters.spilled_blocks += len(session.host_block_ids)
        else:
            self.counters.dropped_sessions += 1

    def take_spills(self) -> list[SpillJob]:
        """Spill jobs made since the last call (their host blocks must be read before any copy into them)."""
        spills, self._spills = self._spills, []
        return spills

    def end_window(self) -> None:
        """The step's copies are sealed (end of ``schedule``): pending offloads count as done."""
        self._fresh.clear()
        self.space.end_window()

    def check_invariants(self) -> None:
        held = sum(len(s.host_block_ids) for s in self.sessions.values())
        assert held == self.num_blocks, f"host sessions hold {held} blocks, counted {self.num_blocks}"
