"""What the KV cache manager reports once per step: an immutable record any thread may read."""

from __future__ import annotations

from dataclasses import dataclass

from streamkv.cache.session_pins import SessionPin


@dataclass(frozen=True, slots=True)
class OffloadStats:
    """Idle sessions off the device pool (immutable; safe to read from any thread).

    Gauges: ``host_sessions`` / ``host_blocks`` (sessions in the host tier
    and the host blocks they hold), ``disk_sessions`` / ``disk_blocks`` /
    ``disk_bytes`` (the disk tier's index, writes in flight included).
    Monotonic counters, sessions and blocks: ``offloaded_*`` (device ->
    host), ``restored_*`` (host -> device), ``spilled_*`` (host -> disk),
    ``disk_restored_*`` (disk -> host), ``dropped_sessions`` (KV forgotten:
    no room in the host tier and no disk, or over the disk cap),
    ``disk_errors`` (writes or reads that failed: the session recomputes);
    bytes: ``offloaded_bytes`` (device -> host), ``restored_bytes`` (host ->
    device), ``disk_written_bytes``, ``disk_read_bytes``.
    """

    host_sessions: int = 0
    host_blocks: int = 0
    disk_sessions: int = 0
    disk_blocks: int = 0
    disk_bytes: int = 0
    offloaded_sessions: int = 0
    offloaded_blocks: int = 0
    offloaded_bytes: int = 0
    restored_sessions: int = 0
    restored_blocks: int = 0
    restored_bytes: int = 0
    spilled_sessions: int = 0
    spilled_blocks: int = 0
    disk_restored_sessions: int = 0
    disk_restored_blocks: int = 0
    dropped_sessions: int = 0
    disk_errors: int = 0
    disk_written_bytes: int = 0
    disk_read_bytes: int = 0


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """What the KV cache manager reports each step (immutable; safe to read from any thread).

    Attributes:
        num_blocks: device pool size.
        block_size: tokens per block.
        states: one :class:`~streamkv.cache.block_pool.BlockState` byte per block.
        num_sessions: sessions holding a pin.
        num_pinned_blocks: blocks held by session pins.
        prefix_cache_queries: prompt tokens looked up (monotonic).
        prefix_cache_hits: prompt tokens found cached or pinned (monotonic).
        evictions: cached blocks evicted for reuse (monotonic).
        cow_copies: copy-on-write copies (monotonic).
        num_swapped_out_blocks: blocks copied to the host tier (monotonic).
        pins: the session pins, least recently active first (shared, never mutated).
        offload: the host and disk tiers (see :class:`OffloadStats`).
    """

    num_blocks: int
    block_size: int
    states: bytes
    num_sessions: int
    num_pinned_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    evictions: int
    cow_copies: int
    num_swapped_out_blocks: int
    pins: tuple[SessionPin, ...]
    offload: OffloadStats = OffloadStats()
