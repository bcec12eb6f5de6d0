"""Session pins: idle chat sessions' holds on the blocks of their history.

When a turn ends, the session keeps one reference on each block holding the
turn's computed tokens (SGLang's ``lock_ref``); the next turn of that session
continues from that block table instead of recomputing the history. Pins are
kept in activity order (least recently active first) and bounded in blocks,
so the cache manager can give way to running work by unpinning the oldest.

:class:`SessionPins` counts the pins and marks them on the pool
(``pin_cnt``); moving references between sequences and sessions, and
freeing, stays with :class:`streamkv.cache.kv_cache_manager.KVCacheManager`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass, field

from streamkv.cache.block import KVBlock
from streamkv.cache.block_pool import BlockPool


@dataclass(slots=True)
class SessionPin:
    """An idle session's hold on the blocks of its history."""

    session_id: str
    blocks: list[KVBlock]
    token_ids: list[int]  # tokens whose KV the blocks hold, in order
    history_tail: list[int] = field(default_factory=list)  # the turn's tokens after them (never computed)

    def num_reusable_tokens(self, token_ids: list[int], block_size: int) -> int:
        """Tokens of ``token_ids`` (a new prompt of this session) whose KV the pin already holds.

        The longest common prefix of the pinned tokens and the prompt (a
        cancelled turn may have computed a token the client never saw),
        capped so the prompt's last token is computed. A partly reused block
        that is a cached full block is not reused (its other tokens must stay
        intact for prefix hits): the prefix then ends at its start. 0: nothing
        reusable.
        """
        limit = min(len(self.token_ids), len(token_ids) - 1)
        if token_ids[:limit] == self.token_ids[:limit]:
            n = limit
        else:
            n = next(i for i in range(limit) if token_ids[i] != self.token_ids[i])
        if n % block_size and self.blocks[n // block_size].block_hash is not None:
            n -= n % block_size
        return n


class SessionPins(Mapping[str, SessionPin]):
    """Session id -> :class:`SessionPin`, read-only, iterated least recently active first.

    Args:
        pool: the pool whose blocks are pinned.
        max_pinned_blocks: most blocks the pins may hold together.
    """

    def __init__(self, pool: BlockPool, max_pinned_blocks: int) -> None:
        self._pool = pool
        self.max_pinned_blocks = max_pinned_blocks
        self.num_pinned_blocks = 0
        self._pins: OrderedDict[str, SessionPin] = OrderedDict()  # LRU first

    def __getitem__(self, session_id: str) -> SessionPin:
        return self._pins[session_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._pins)

    def __len__(self) -> int:
        return len(self._pins)

    # The dict's own views: list(pins.items()) then copies in one C call, as it
    # did when this was a bare OrderedDict (the stats thread reads it that way).
    def keys(self) -> KeysView[str]:
        return self._pins.keys()

    def items(self) -> ItemsView[str, SessionPin]:
        return self._pins.items()

    def values(self) -> ValuesView[SessionPin]:
        return self._pins.values()

    def fits(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` more pinned blocks stay within ``max_pinned_blocks``."""
        return self.num_pinned_blocks + num_blocks <= self.max_pinned_blocks

    def least_recently_active(self) -> str | None:
        """The session to unpin first, ``None`` if there is no pin."""
        return next(iter(self._pins), None)

    def add(
        self, session_id: str, blocks: list[KVBlock], token_ids: list[int], history_tail: list[int] | None = None
    ) -> None:
        """Turn one existing reference of each block into the most recent session's pin.

        Raises:
            ValueError: the session already holds a pin, or a block has no
                unpinned reference to turn.
        """
        if session_id in self._pins:
            raise ValueError(f"session {session_id!r} is already pinned")
        self._pool.pin(blocks)
        self.num_pinned_blocks += len(blocks)
        self._pins[session_id] = SessionPin(session_id, blocks, token_ids, history_tail or [])

    def remove(self, session_id: str) -> SessionPin | None:
        """Unmark a session's pin; the caller then owns (and frees) its references."""
        pin = self._pins.pop(session_id, None)
        if pin is None:
            return None
        self._pool.unpin(pin.blocks)
        self.num_pinned_blocks -= len(pin.blocks)
        return pin

    def check_invariants(self) -> None:
        """Assert the pinned count matches the pins and every pinned block is marked."""
        pinned = sum(len(p.blocks) for p in self._pins.values())
        assert pinned == self.num_pinned_blocks, f"pinned count {self.num_pinned_blocks} != {pinned}"
        for pin in self._pins.values():
            for b in pin.blocks:
                assert b.pin_cnt >= 1 and b.ref_cnt >= 1, f"pinned block {b.block_id} unreferenced"
