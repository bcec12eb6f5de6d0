"""The chain registry's Responses/x-session-id side and the response store, with a fake clock and no engine."""

from __future__ import annotations

from streamkv.server.responses.store import ResponseStore, StoredResponse
from streamkv.server.sessions import SessionRegistry, SessionState


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def registry(clock: Clock, released: list[str], ttl: float = 10.0) -> SessionRegistry:
    return SessionRegistry(released.append, ttl, clock=clock)


def stored(sessions: SessionRegistry, rid: str) -> StoredResponse:
    """A finished response that is the head of its own detached chain."""
    chain = sessions.create()
    assert sessions.acquire(chain)
    chain.history = [1, 2, 3]
    chain.head = rid
    sessions.park(chain, keep=True)
    return StoredResponse(rid, chain.history, chain, {"id": rid})


def test_acquire_resumes_a_detached_chain_and_refuses_a_busy_or_expired_one() -> None:
    clock, released = Clock(), []
    sessions = registry(clock, released)
    chain = sessions.create()
    assert sessions.acquire(chain) and chain.state is SessionState.GENERATING
    assert not sessions.acquire(chain)  # a turn in flight
    sessions.park(chain, keep=True)
    assert chain.state is SessionState.DETACHED and sessions.num_detached == 1
    assert sessions.acquire(chain) and sessions.num_detached == 0
    sessions.park(chain, keep=True)
    clock.now = 11.0
    assert not sessions.acquire(chain) and chain.state is SessionState.CLOSED
    assert released == [chain.session_id]


def test_park_without_keep_releases() -> None:
    clock, released = Clock(), []
    sessions = registry(clock, released)
    chain = sessions.create()
    sessions.acquire(chain)
    sessions.park(chain, keep=False)
    assert chain.state is SessionState.CLOSED and released == [chain.session_id] and len(sessions) == 0


def test_an_alias_names_one_live_chain() -> None:
    clock, released = Clock(), []
    sessions = registry(clock, released)
    first = sessions.create(resumable=True, alias="conv")
    assert sessions.by_alias("conv") is first
    second = sessions.create(resumable=True, alias="conv")  # the old chain of that alias is released
    assert sessions.by_alias("conv") is second and first.state is SessionState.CLOSED
    sessions.release(second)
    assert sessions.by_alias("conv") is None and released == [first.session_id, second.session_id]


def test_the_store_drops_the_least_recently_used_and_a_dropped_head_releases_its_chain() -> None:
    clock, released = Clock(), []
    sessions = registry(clock, released)
    store = ResponseStore(sessions, ttl=None, max_responses=2, clock=clock)
    a, b, c = (stored(sessions, rid) for rid in "abc")
    store.put(a)
    store.put(b)
    assert store.get("a") is a  # a is now the most recently used
    store.put(c)
    assert store.get("b") is None and len(store) == 2
    assert b.chain.state is SessionState.CLOSED and released == [b.chain.session_id]
    assert store.delete("a") and not store.delete("a")
    assert a.chain.state is SessionState.CLOSED and not a.is_head
    assert c.is_head


def test_the_store_ages_responses_out_and_keeps_a_chain_whose_head_moved_on() -> None:
    clock, released = Clock(), []
    sessions = registry(clock, released, ttl=100.0)
    store = ResponseStore(sessions, ttl=5.0, max_responses=10, clock=clock)
    old = stored(sessions, "old")
    store.put(old)
    old.chain.head = "newer"  # the chain went on to a newer response
    clock.now = 6.0
    assert store.get("old") is None
    assert old.chain.state is SessionState.DETACHED and released == []  # not its head: the chain stays
