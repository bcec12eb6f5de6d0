"""An intrusive doubly linked list of free blocks, in eviction order.

The front is evicted first. Removing a block from the middle (a prefix
cache hit revives a free block) is O(1), which a deque cannot do (vLLM v1's
``FreeKVCacheBlockQueue``)::

    head <-> b7 <-> b3 <-> b9 <-> tail      popleft() -> b7
"""

from __future__ import annotations

from collections.abc import Iterator

from streamkv.cache.block import KVBlock


class FreeBlockQueue:
    """Free blocks linked through their own ``prev_free`` / ``next_free`` fields."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head: KVBlock | None = None
        self._tail: KVBlock | None = None
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        """Remove and return the front block.

        Raises:
            IndexError: the queue is empty.
        """
        block = self._head
        if block is None:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        """Put ``block`` at the back (evicted last)."""
        if block.in_free_queue:
            raise ValueError(f"block {block.block_id} is already free")
        block.prev_free = self._tail
        block.next_free = None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        block.in_free_queue = True
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from anywhere in the queue."""
        if not block.in_free_queue:
            raise ValueError(f"block {block.block_id} is not free")
        if block.prev_free is None:
            self._head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self._tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        block.in_free_queue = False
        self.num_free -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head
        while block is not None:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free
