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

    Allocation hands out consecutive ids where it can, the lowest first: a
    session's host blocks then form one run, so its offload and restore copy
    slices rather than scattered blocks (:mod:`streamkv.cache.block_copy`),
    and low ids, whose pages were written before, are reused before pages
    never touched (a first write into a page costs a page fault).

    Args:
        num_blocks: host blocks; the cache manager never makes this larger
            than the device pool when sessions are not offloaded.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self.num_blocks = num_blocks
        self._next = 0  # ids from here on were never handed out
        self._free: set[int] = set()  # ids below _next handed back
        self._freed_this_window: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - self._next

    @property
    def num_used_blocks(self) -> int:
        """Blocks not allocatable now: held, or released but still read by a pending copy."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_quarantined_blocks(self) -> int:
        return len(self._freed_this_window)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` host block ids, consecutive where possible.

        In order of preference: the lowest run of ``n`` consecutive ids handed
        back earlier (pages already written), a run of never used ids, the
        never used ids left plus the lowest handed back. O(r log r) for ``r`` ids handed back and not
        taken again (at most the tier's peak use).

        Raises:
            ValueError: fewer than ``n`` are free.
        """
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} host blocks, {self.num_free_blocks} free")
        if n == 0:
            return []
        back = sorted(self._free)
        start = next((i for i in range(len(back) - n + 1) if back[i + n - 1] - back[i] == n - 1), None)
        if start is not None:
            taken = back[start : start + n]
        else:
            fresh = min(self.num_blocks - self._next, n)
            taken = back[: n - fresh] + list(range(self._next, self._next + fresh))
            self._next += fresh
        self._free.difference_update(taken)
        return taken

    def free(self, block_ids: list[int]) -> None:
        """Return host block ids.

        Raises:
            ValueError: an id is out of range or already free.
        """
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"bad host block free: repeated ids in {block_ids}")
        for block_id in block_ids:
            if not 0 <= block_id < self._next or block_id in self._free:
                raise ValueError(f"bad host block free: {block_id}")
        self._free.update(block_ids)

    def free_later(self, block_ids: list[int]) -> None:
        """Release host block ids that a copy of the current step may still read."""
        self._freed_this_window.extend(block_ids)

    def end_window(self) -> None:
        """The step's copies are sealed (end of ``schedule``): free what it released with :meth:`free_later`."""
        freed, self._freed_this_window = self._freed_this_window, []
        self.free(freed)
