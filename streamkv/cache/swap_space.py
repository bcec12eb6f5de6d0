"""Host (CPU) block ids for swapped-out KV; the tensors live in the runner."""

from __future__ import annotations


class SwapSpace:
    """A bounded pool of host block ids.

    Args:
        num_blocks: host blocks; the cache manager never makes this larger
            than the device pool.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` host block ids.

        Raises:
            ValueError: fewer than ``n`` are free.
        """
        if n > len(self._free):
            raise ValueError(f"asked for {n} host blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        """Return host block ids.

        Raises:
            ValueError: an id is out of range or already free.
        """
        free = set(self._free)
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks or block_id in free:
                raise ValueError(f"bad host block free: {block_id}")
            free.add(block_id)
            self._free.append(block_id)
