"""One KV block as the pool tracks it, and the state the block map shows for it.

A leaf module: :mod:`streamkv.cache.free_block_queue` links blocks through
their own fields and :mod:`streamkv.cache.block_pool` owns them; both import
from here, so neither imports the other's module for the type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from streamkv.cache.hashing import BlockHash


class BlockState(IntEnum):
    """What the block map shows for a block (one byte per block)."""

    FREE = 0
    CACHED = 1  # free, holds a reusable full block, evictable
    USED = 2  # one reference, from a running sequence
    PINNED = 3  # one reference, from an idle session's pin
    SHARED = 4  # more than one reference


STATE_NAMES = tuple(s.name.lower() for s in BlockState)


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical block of ``block_size`` token slots."""

    block_id: int
    ref_cnt: int = 0
    pin_cnt: int = 0  # how many of ref_cnt are session pins
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # contents, set with block_hash
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)
    in_free_queue: bool = False


class CacheSeq(Protocol):
    """What the cache manager reads of a sequence."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints: the blocks ``a`` tokens fill at ``b`` tokens per block."""
    return -(-a // b)
