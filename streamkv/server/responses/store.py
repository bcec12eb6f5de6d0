"""Finished responses by id: what ``previous_response_id`` and ``GET /v1/responses/{id}`` find.

A :class:`StoredResponse` names the exact token ids of its chain up to and
including its output, and the chain (:class:`~streamkv.server.sessions.Session`)
it ended on; while it is that chain's ``head`` it also names the chain's
pinned blocks. The conversation state itself is the chain's: this store is
the index of response ids onto chains, bounded in count (LRU) and in age
(TTL). Dropping a response that is still its chain's head releases the chain
(and with it the engine's pin).

One server-wide store holds ``store: true`` responses; each WebSocket keeps a
small one of its own for ``store: false`` (gone with the socket).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamkv.server.sessions import Session, SessionRegistry, SessionState

MAX_SWEEP = 256  # most expired entries one call drops


@dataclass(slots=True)
class StoredResponse:
    """A finished response.

    Attributes:
        response_id: the secret id.
        token_ids: prompt + output ids; a continuation's prompt starts with exactly these.
        chain: the chain it was the newest response of when it finished.
        body: the ``Response`` object as served.
        last_active: monotonic seconds of its creation or last use.
    """

    response_id: str
    token_ids: list[int]
    chain: Session
    body: dict[str, Any]
    last_active: float = 0.0

    @property
    def is_head(self) -> bool:
        """Still the newest response of a live chain (its continuation adopts the pin)."""
        return self.chain.head == self.response_id and self.chain.state is not SessionState.CLOSED


@dataclass(frozen=True, slots=True)
class ChainView:
    """What a stored response shows in the block map.

    Attributes:
        pin_key: the chain's session id (the engine's pin key; never shown to the viewer).
        num_tokens: show only the blocks of this many leading tokens (an older
            response of the chain); ``None``: every block of the chain (its newest response).
    """

    pin_key: str
    num_tokens: int | None


class ResponseStore:
    """Response id -> :class:`StoredResponse`, least recently used first; event-loop only.

    Args:
        sessions: the chain registry (a dropped head releases its chain).
        ttl: seconds an unused response is kept (``None``: until evicted).
        max_responses: most responses kept; over it the least recently used is dropped.
    """

    def __init__(
        self,
        sessions: SessionRegistry,
        ttl: float | None,
        max_responses: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sessions = sessions
        self.ttl = ttl
        self.max_responses = max_responses
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        """The response, refreshed as recently used; ``None`` when unknown or expired."""
        self.sweep()
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        entry.last_active = self._clock()
        self._entries.move_to_end(response_id)
        return entry

    def peek(self, response_id: str) -> StoredResponse | None:
        """The response if it is stored and not expired, without refreshing it (a viewer keeps nothing alive)."""
        entry = self._entries.get(response_id)
        if entry is None or (self.ttl is not None and self._clock() - entry.last_active > self.ttl):
            return None
        return entry

    def chain_view(self, response_id: str) -> ChainView | None:
        """Which blocks the block map shows for ``response_id`` (``/ws/stats?response_id=``).

        The newest response of a live chain names all of the chain's blocks
        (its pin, or its turn in flight); an older response of a live chain
        names the blocks that hold its token prefix (the chain only ever
        appends, so that is the first ``ceil(len(token_ids) / block_size)``
        blocks). ``None`` for an unknown or expired id and for a response
        whose chain is gone, alike.
        """
        entry = self.peek(response_id)
        if entry is None or entry.chain.state is SessionState.CLOSED:
            return None
        if entry.is_head:
            return ChainView(entry.chain.session_id, None)
        n = len(entry.token_ids)
        if entry.chain.history[:n] != entry.token_ids:
            return None  # not this chain's prefix (cannot happen while chains only append)
        return ChainView(entry.chain.session_id, n)

    def put(self, entry: StoredResponse) -> None:
        """Keep ``entry`` (the least recently used one goes when at the cap)."""
        self.sweep()
        entry.last_active = self._clock()
        self._entries[entry.response_id] = entry
        self._entries.move_to_end(entry.response_id)
        while len(self._entries) > self.max_responses:
            _, oldest = self._entries.popitem(last=False)
            self._forget(oldest)

    def delete(self, response_id: str) -> bool:
        """Drop a response; ``False`` if it was unknown."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._forget(entry)
        return True

    def clear(self) -> None:
        while self._entries:
            _, entry = self._entries.popitem(last=False)
            self._forget(entry)

    def sweep(self) -> int:
        """Drop up to ``MAX_SWEEP`` responses unused for longer than the TTL; returns how many."""
        if self.ttl is None:
            return 0
        dropped = 0
        now = self._clock()
        while self._entries and dropped < MAX_SWEEP:
            entry = next(iter(self._entries.values()))
            if now - entry.last_active <= self.ttl:
                break
            self._entries.popitem(last=False)
            self._forget(entry)
            dropped += 1
        return dropped

    def _forget(self, entry: StoredResponse) -> None:
        """A dropped head takes its idle chain with it; a chain mid-turn lets go when its turn ends."""
        chain = entry.chain
        if chain.head == entry.response_id:
            chain.head = None
            if chain.state in (SessionState.DETACHED, SessionState.IDLE):
                self._sessions.release(chain)
