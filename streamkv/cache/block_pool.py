"""The block pool: every KV block, its ref count, its hash, and the free list.

Knows block ids and token ids only; never a tensor. A block is in exactly
one of two places: referenced (``ref_cnt > 0``, held by sequences and/or
session pins) or in the free queue (``ref_cnt == 0``). A free block that
still carries a ``block_hash`` is *cached*: a prefix hit revives it, an
allocation evicts it (least recently freed first).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from streamkv.cache.block import STATE_NAMES, BlockState, KVBlock
from streamkv.cache.free_block_queue import FreeBlockQueue
from streamkv.cache.hashing import BlockHash


@dataclass(slots=True)
class PoolCounters:
    """Monotonic counters (read by metrics)."""

    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    evictions: int = 0
    cow_copies: int = 0


class BlockPool:
    """All device blocks of the KV pool.

    Args:
        num_blocks: pool size.
        enable_caching: keep hashes of freed full blocks for reuse.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.counters = PoolCounters()
        self.num_pinned_blocks = 0  # blocks with a pin, each counted once however many sessions pin it
        # one byte per block, kept current on every change: snapshots are a copy
        self.states = bytearray(num_blocks)

    # ------------------------------------------------------------------ public

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (free or cached): what allocate() can take."""
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of blocks referenced, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the front of the free queue, evicting cached ones.

        Raises:
            ValueError: fewer than ``n`` blocks are free (callers check first).
        """
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            self._refresh(block)
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each block, reviving free (cached) ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            self._refresh(block)

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given.

        Blocks reaching zero join the back of the free queue, so callers pass
        a sequence's blocks tail first: tails are then evicted before the
        prefixes they extend.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            if block.ref_cnt <= block.pin_cnt:  # checked first: a refused free changes nothing
                raise ValueError(f"block {block.block_id} freed while pinned")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
            self._refresh(block)

    def pin(self, blocks: Iterable[KVBlock]) -> None:
        """Mark one existing reference of each block as a session pin."""
        for block in blocks:
            if block.pin_cnt >= block.ref_cnt:
                raise ValueError(f"pinning block {block.block_id} without a reference")
            block.pin_cnt += 1
            self.num_pinned_blocks += block.pin_cnt == 1
            self._refresh(block)

    def unpin(self, blocks: Iterable[KVBlock]) -> None:
        """Turn one pin of each block back into a plain reference."""
        for block in blocks:
            if block.pin_cnt <= 0:
                raise ValueError(f"block {block.block_id} is not pinned")
            block.pin_cnt -= 1
            self.num_pinned_blocks -= block.pin_cnt == 0
            self._refresh(block)

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> KVBlock | None:
        """The cached block for ``block_hash`` whose tokens equal ``token_ids``."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def cache_block(self, block: KVBlock, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """Register a just-filled block under ``block_hash`` (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is already cached; this copy stays private
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block
        self._refresh(block)

    def evict_all_cached(self) -> int:
        """Drop the hash of every free cached block (they become plain free blocks); returns the count."""
        victims = [b for b in self.blocks if b.block_hash is not None and b.ref_cnt == 0]
        for block in victims:
            self._evict(block)
        return len(victims)

    def state_counts(self) -> dict[str, int]:
        """Blocks per :class:`BlockState`, from the state bytes."""
        states = bytes(self.states)
        return {name: states.count(i) for i, name in enumerate(STATE_NAMES)}

    def check_invariants(self, expected_refs: dict[int, int] | None = None) -> None:
        """Assert the pool is consistent; raise AssertionError naming the fault.

        Args:
            expected_refs: block id -> references held by sequences and pins,
                as counted by the caller; every block not named must be unreferenced.
        """
        free_ids = set()
        for block in self.free_queue:
            assert block.block_id not in free_ids, f"block {block.block_id} twice in free queue"
            free_ids.add(block.block_id)
        assert len(free_ids) == self.free_queue.num_free, "free queue length mismatch"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} ref_cnt {block.ref_cnt} < 0"
            assert 0 <= block.pin_cnt <= block.ref_cnt, f"block {block.block_id} pinned without reference"
            is_free = block.block_id in free_ids
            assert is_free == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue = {is_free}"
            )
            assert block.in_free_queue == is_free
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"block {block.block_id} hash not indexed"
            assert self.states[block.block_id] == self._state_of(block), f"block {block.block_id} state stale"
            if expected_refs is not None:
                want = expected_refs.get(block.block_id, 0)
                assert block.ref_cnt == want, f"block {block.block_id}: ref_cnt {block.ref_cnt}, holders {want}"
        num_pinned = sum(1 for b in self.blocks if b.pin_cnt)
        assert self.num_pinned_blocks == num_pinned, f"pinned count {self.num_pinned_blocks} != {num_pinned}"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, "cached map points to a block with another hash"

    # --------------------------------------------------------------- internals

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        self.counters.evictions += 1
        self._refresh(block)

    @staticmethod
    def _state_of(block: KVBlock) -> BlockState:
        if block.ref_cnt == 0:
            return BlockState.CACHED if block.block_hash is not None else BlockState.FREE
        if block.ref_cnt > 1:
            return BlockState.SHARED
        return BlockState.PINNED if block.pin_cnt else BlockState.USED

    def _refresh(self, block: KVBlock) -> None:
        self.states[block.block_id] = self._state_of(block)
