from __future__ import annotations

import asyncio

import pytest

from streamkv.errors import EngineError
from streamkv.server.sessions import IllegalTransition, Session, SessionRegistry, SessionState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(ttl: float = 10.0, max_sweep: int = 256) -> tuple[SessionRegistry, list[str], Clock]:
    released: list[str] = []
    clock = Clock()
    return SessionRegistry(released.append, ttl, clock=clock, max_sweep=max_sweep), released, clock


def test_lifecycle_and_illegal_transitions() -> None:
    s = Session("s1")
    s.transition(SessionState.GENERATING, 1.0)
    with pytest.raises(IllegalTransition, match="s1: cannot go from generating to detached"):
        s.transition(SessionState.DETACHED, 2.0)
    with pytest.raises(IllegalTransition):
        s.transition(SessionState.CLOSED, 2.0)
    s.transition(SessionState.IDLE, 3.0)
    s.transition(SessionState.CLOSED, 4.0)
    for state in SessionState:
        with pytest.raises(IllegalTransition):
            s.transition(state, 5.0)
    assert s.last_active == 4.0


def test_ids_are_unique_and_unguessable() -> None:
    reg, _, _ = make()
    ids = {reg.create().session_id for _ in range(200)}
    assert len(ids) == 200 and all(len(i) >= 20 for i in ids)


def test_detach_releases_unless_resumable() -> None:
    reg, released, _ = make()
    plain, keep = reg.create(), reg.create(resumable=True)
    reg.detach(plain)
    reg.detach(keep)
    assert released == [plain.session_id]
    assert plain.state is SessionState.CLOSED and keep.state is SessionState.DETACHED
    assert reg.get(plain.session_id) is None and len(reg) == 1 and reg.num_detached == 1


def test_resume() -> None:
    reg, released, clock = make(ttl=10.0)
    s = reg.create(resumable=True)
    s.history = [1, 2, 3]
    with pytest.raises(EngineError) as busy:
        reg.resume(s.session_id)  # still attached
    assert busy.value.code == "session_busy"
    reg.detach(s)
    clock.now += 9.0
    again = reg.resume(s.session_id)
    assert again is s and s.state is SessionState.IDLE and s.history == [1, 2, 3] and reg.num_detached == 0
    with pytest.raises(EngineError) as unknown:
        reg.resume("nope")
    assert unknown.value.code == "unknown_session"
    assert released == []


def test_resume_after_ttl_is_unknown_even_before_a_sweep() -> None:
    reg, released, clock = make(ttl=10.0)
    s = reg.create(resumable=True)
    reg.detach(s)
    clock.now += 10.5
    with pytest.raises(EngineError) as info:
        reg.resume(s.session_id)
    assert info.value.code == "unknown_session"
    assert released == [s.session_id]


def test_sweep_releases_expired_in_bounded_batches() -> None:
    reg, released, clock = make(ttl=5.0, max_sweep=3)
    old = [reg.create(resumable=True) for _ in range(5)]
    for s in old:
        reg.detach(s)
    clock.now += 4.0
    young = reg.create(resumable=True)
    reg.detach(young)
    clock.now += 2.0  # old ones: 6 s idle, young: 2 s
    assert reg.sweep() == 3
    assert reg.sweep() == 2
    assert reg.sweep() == 0
    assert released == [s.session_id for s in old]
    assert reg.get(young.session_id) is young


def test_release_is_idempotent_and_survives_engine_errors() -> None:
    def boom(session_id: str) -> None:
        raise RuntimeError("engine gone")

    reg = SessionRegistry(boom, 1.0)
    s = reg.create()
    reg.release(s)
    reg.release(s)
    assert s.state is SessionState.CLOSED and s.history == [] and len(reg) == 0


def test_close_all_releases_detached_only() -> None:
    reg, released, _ = make()
    attached, detached = reg.create(), reg.create(resumable=True)
    reg.detach(detached)
    reg.close_all()
    assert released == [detached.session_id]
    assert attached.state is SessionState.IDLE


@pytest.mark.timeout(5)
def test_sweeper_task_expires_sessions() -> None:
    async def main() -> list[str]:
        released: list[str] = []
        reg = SessionRegistry(released.append, 0.05)
        reg.detach(reg.create(resumable=True))
        task = asyncio.create_task(reg.run_sweeper())
        for _ in range(200):
            if released:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return released

    assert len(asyncio.run(main())) == 1


def test_max_sessions_evicts_the_longest_detached_first() -> None:
    released: list[str] = []
    clock = Clock()
    reg = SessionRegistry(released.append, 10.0, clock=clock, max_sessions=3)
    a, b, c = (reg.create(resumable=True) for _ in range(3))
    reg.detach(b)
    clock.now += 1
    reg.detach(a)
    d = reg.create()  # over the cap: b detached first, so b goes
    assert released == [b.session_id] and reg.get(b.session_id) is None and b.state is SessionState.CLOSED
    assert len(reg) == 3 and reg.num_detached == 1
    with pytest.raises(EngineError) as e:
        reg.resume(b.session_id)
    assert e.value.code == "unknown_session"
    reg.create()  # then a
    assert released == [b.session_id, a.session_id] and reg.num_detached == 0
    with pytest.raises(EngineError) as e:  # every session attached: refused, nothing released
        reg.create()
    assert e.value.code == "too_many_sessions" and "3 sessions" in e.value.message
    assert len(reg) == 3 and released == [b.session_id, a.session_id]
    reg.release(d)
    assert reg.create().state is SessionState.IDLE and c.state is SessionState.IDLE
