"""Idle-session offload across tiers: device pool -> host tier -> disk tier, and back.

The cache manager decides where a session's KV goes (block ids only); this
class does what needs tensors or files, on the engine thread:

- a step's spill jobs (host sessions evicted to disk): their host blocks
  are read before the step's copies (:meth:`SessionOffload.read_spills`),
  then queued for the disk tier's writer thread (:meth:`write_spills`);
- a new turn of a session that lives on disk: its file is read and
  checked on the disk tier's reader thread (:meth:`prepare_turn`) while the
  scheduler keeps the turn waiting and the steps go on; the step after the
  read lands writes the KV into host blocks (:meth:`poll`), and admission
  restores it like any host session;
- shutdown: every pinned and host session is saved (:meth:`save_all`), and
  a restart lists them (:meth:`saved_sessions`).

Cost on the engine thread: a spill is one host-tensor gather, a disk
restore one host-tensor scatter (memcpy-speed copies, see
:mod:`streamkv.cache.block_copy`: a few ms for a 17 MiB SmolLM2 session); the
file read and its CRC-32 (tens to hundreds of ms) are off it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Protocol

import torch

from streamkv.cache.cache_stats import OffloadStats
from streamkv.cache.disk_tier import DiskTier, Saved
from streamkv.cache.host_tier import SpillJob
from streamkv.cache.kv_cache_manager import KVCacheManager

logger = logging.getLogger(__name__)


class BlockMover(Protocol):
    """What this module needs of the model runner (tensors per layer, per tensor, block dim 1)."""

    def read_host_blocks(self, host_block_ids: list[int]) -> list[list[torch.Tensor]]: ...

    def write_host_blocks(self, host_block_ids: list[int], data: list[list[torch.Tensor]]) -> None: ...

    def read_device_blocks(self, block_ids: list[int]) -> list[list[torch.Tensor]]: ...


@dataclass(slots=True)
class TransferTimes:
    """Seconds spent on disk-tier work (monotonic)."""

    spill_s: float = 0.0  # engine thread: gathering spilled host blocks
    disk_read_s: float = 0.0  # reader thread: from a read's start to the poll that saw it done
    disk_place_s: float = 0.0  # engine thread: placing read sessions into host blocks
    disk_reads: int = 0


@dataclass(slots=True)
class _Load:
    """A session's disk read in flight."""

    future: Future[Saved | None]
    started: float = field(default_factory=time.perf_counter)
    released: bool = False  # the session was released meanwhile: drop what the read brings


class SessionOffload:
    """The engine's side of the host and disk tiers.

    Args:
        kv: the cache manager (its host tier and pins).
        mover: the model runner.
        disk: the disk tier, or ``None``.
        block_bytes: bytes of one block over all layers (for byte counters).
    """

    def __init__(self, kv: KVCacheManager, mover: BlockMover, disk: DiskTier | None, block_bytes: int) -> None:
        self.kv = kv
        self.mover = mover
        self.disk = disk
        self.block_bytes = block_bytes
        self.times = TransferTimes()
        self._loads: dict[str, _Load] = {}  # disk reads in flight, by session

    def read_spills(self, spills: Iterable[SpillJob]) -> list[list[list[torch.Tensor]]]:
        """Copies of the spilled sessions' host blocks; call before the step's copies."""
        t0 = time.perf_counter()
        data = [self.mover.read_host_blocks(job.session.host_block_ids) for job in spills]
        self.times.spill_s += time.perf_counter() - t0
        return data

    def write_spills(self, spills: Iterable[SpillJob], data: list[list[list[torch.Tensor]]]) -> None:
        """Queue the spilled sessions for the disk tier."""
        if self.disk is None:
            return
        for job, blocks in zip(spills, data, strict=True):
            s = job.session
            self.disk.put(s.session_id, s.token_ids, s.history_tail, blocks)

    def prepare_turn(self, session_id: str) -> None:
        """Before a session's turn is queued: start bringing its KV from disk if it is there.

        Nothing happens when the session is pinned or host-resident. A disk
        read runs on the disk tier's reader thread; until :meth:`poll` places
        it in the host tier the session is *loading*
        (:meth:`~streamkv.cache.host_offload.HostOffloadMixin.is_loading`) and
        the scheduler keeps its turn waiting, while the step goes on. A file
        that cannot be used, or a host tier too small for it, means the turn
        recomputes (logged by the disk tier, or at debug level here).
        """
        kv = self.kv
        if self.disk is None or session_id in kv.sessions:
            return
        if kv.is_offloaded(session_id):
            kv.host_sessions.touch(session_id)
            return
        load = self._loads.get(session_id)
        if load is None:
            future = self.disk.take_async(session_id)
            if future is None:
                return
            self._loads[session_id] = load = _Load(future)
        load.released = False
        kv.host_sessions.loading.add(session_id)

    def poll(self, timeout_s: float = 0.0) -> None:
        """Place the disk reads that have finished into the host tier (engine thread, before ``schedule``).

        ``timeout_s``: wait up to this long for one to finish (an engine with
        nothing else to do), instead of spinning.
        """
        if not self._loads:
            return
        if timeout_s > 0:
            wait([load.future for load in self._loads.values()], timeout_s, FIRST_COMPLETED)
        for session_id, load in list(self._loads.items()):
            if not load.future.done():
                continue
            del self._loads[session_id]
            self.kv.host_sessions.loading.discard(session_id)
            saved = load.future.result()
            self.times.disk_read_s += time.perf_counter() - load.started
            self.times.disk_reads += 1
            if saved is not None and not load.released:
                t0 = time.perf_counter()
                self._place(session_id, *saved)
                self.times.disk_place_s += time.perf_counter() - t0

    def _place(self, session_id: str, token_ids: list[int], history_tail: list[int],
               data: list[list[torch.Tensor]]) -> None:  # fmt: skip
        kv = self.kv
        host_ids = kv.admit_host_session(session_id, token_ids, history_tail)
        evicted = kv.host_sessions.take_spills()  # sessions it pushed to disk: read before overwriting
        self.write_spills(evicted, self.read_spills(evicted))
        if host_ids is None:
            logger.debug("session's %d saved blocks do not fit the host tier: it recomputes", data[0][0].shape[1])
            return
        try:
            self.mover.write_host_blocks(host_ids, data)
        except ValueError as e:  # another layout slipped past the fingerprint: never use it
            logger.warning("saved KV does not fit this cache (%s): the session recomputes", e)
            kv.release_session(session_id)

    def release(self, session_id: str) -> None:
        """The session is gone: forget its saved KV too (a read in flight is dropped when it lands)."""
        if self.disk is not None:
            self.disk.discard(session_id)
        load = self._loads.get(session_id)
        if load is not None:
            load.released = True
            self.kv.host_sessions.loading.discard(session_id)

    def saved_sessions(self) -> list[tuple[str, list[int]]]:
        """``(session_id, history)`` of the sessions the disk tier held at start (restart)."""
        if self.disk is None:
            return []
        return [(e.session_id, e.token_ids + e.history_tail) for e in self.disk.saved_at_start
                if e.session_id in self.disk.entries]  # fmt: skip

    def save_all(self) -> int:
        """Shutdown: save every pinned and host session to disk, wait for the writes; returns how many."""
        if self.disk is None:
            return 0
        while self._loads:  # reads in flight land in the host tier first, and are saved with it
            self.poll(timeout_s=1.0)
        kv = self.kv
        n = 0
        for pin in list(kv.sessions.values()):
            data = self.mover.read_device_blocks([b.block_id for b in pin.blocks])
            n += self.disk.put(pin.session_id, pin.token_ids, pin.history_tail, data)
        for s in list(kv.host_sessions.sessions.values()):
            data = self.mover.read_host_blocks(s.host_block_ids)
            n += self.disk.put(s.session_id, s.token_ids, s.history_tail, data)
        self.disk.flush()
        logger.info("saved %d idle sessions to %s", n, self.disk.directory)
        return n

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> OffloadStats:
        """Host-tier stats from the cache manager plus the disk tier's."""
        host = self.kv.offload_stats(self.block_bytes)
        if self.disk is None:
            return host
        d = self.disk.stats()
        return OffloadStats(
            host_sessions=host.host_sessions,
            host_blocks=host.host_blocks,
            disk_sessions=d.sessions,
            disk_blocks=d.blocks,
            disk_bytes=d.bytes,
            offloaded_sessions=host.offloaded_sessions,
            offloaded_blocks=host.offloaded_blocks,
            offloaded_bytes=host.offloaded_bytes,
            restored_sessions=host.restored_sessions,
            restored_blocks=host.restored_blocks,
            restored_bytes=host.restored_bytes,
            spilled_sessions=host.spilled_sessions,
            spilled_blocks=host.spilled_blocks,
            disk_restored_sessions=d.restored_sessions,
            disk_restored_blocks=d.restored_blocks,
            dropped_sessions=host.dropped_sessions + d.dropped_sessions,
            disk_errors=d.errors,
            disk_written_bytes=d.written_bytes,
            disk_read_bytes=d.read_bytes,
        )
