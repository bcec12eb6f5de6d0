"""What the KV cache manager reports once per step: an immutable record any thread may read."""

from __future__ import annotations

from dataclasses import dataclass

from streamkv.cache.session_pins import SessionPin


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
