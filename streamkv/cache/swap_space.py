"""Host (CPU) block ids for swapped-out KV; the tensors live in the runner."""

from __future__ import annotations


class SwapSpace:
    """A bounded pool of host block ids.

    The swap tier is shared by preempted sequences (``--preemption-mode
    swap``) and by idle sessions offloaded off the device pool
    (:mod:`streamkv.cache.host_tier`).

    A host block that is the source of a swap-in of the step being scheduled
    is released with :meth:`free_later`: it becomes allocatable only at
    :meth:`end_window` (the end of ``schedule``), so no device -> host copy
    into it rides on the same step (the runner applies every device -> host
    copy of a step before any host -> device copy).

    Args:
        num_blocks: host blocks; the cache manager never makes this larger
            than the device pool.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._freed_this_window: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks not allocatable now: held, or released but still read by a pending copy."""
        return self.num_blocks - len(self._free)

    @property
    def num_quarantined_blocks(self) -> int:
        return len(self._freed_this_window)

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

    def free_later(self, block_ids: list[int]) -> None:
        """Release host block ids that a copy of the current step may still read."""
        self._freed_this_window.extend(block_ids)

    def end_window(self) -> None:
        """The step's copies are sealed (end of ``schedule``): free what it released with :meth:`free_later`."""
        freed, self._freed_this_window = self._freed_this_window, []
        self.free(freed)
