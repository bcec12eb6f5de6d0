"""Chat sessions, which are chains: a conversation's exact token ids, its pin key and its lifecycle.

A session is a chain. One record serves every front door: a ``/ws/chat``
session, a Responses API chain (``previous_response_id``) and a chat
completions conversation named by the ``x-session-id`` header. It holds the
exact token ids of the conversation so far (the last prompt plus the ids
generated for sample 0; a chained turn appends to them and never
re-tokenizes) and its ``session_id``, the key under which the engine pins the
chain's KV blocks between turns. The server decides when the pin is dropped
(``engine.release_session``).

Lifecycle (one place; an illegal transition raises; chains that no socket
holds go through ``acquire`` / ``end_turn`` / ``park``)::

    create ──> IDLE ──turn──> GENERATING ──turn ends──> IDLE
               IDLE ──socket closes, resumable──> DETACHED ──resume──> IDLE
               IDLE ──reset / socket closes / shutdown──> CLOSED
           DETACHED ──idle past session_ttl / evicted at max_sessions / shutdown──> CLOSED

A turn always ends (GENERATING -> IDLE) before its socket lets go of the
session, so a session is never detached or released mid-turn.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from streamkv.errors import EngineError, ErrorCode
from streamkv.server.engine_api import ChatFormatterLike

logger = logging.getLogger(__name__)

# A client-chosen session id (the ``x-session-id`` a balancer hashes): long enough to stay unguessable.
CLIENT_SESSION_ID = re.compile(r"^[A-Za-z0-9._:-]{16,128}$")


class SessionState(enum.Enum):
    IDLE = "idle"  # attached to a socket, no turn in flight
    GENERATING = "generating"  # attached, one turn in flight
    DETACHED = "detached"  # resumable, no socket; the TTL clock runs
    CLOSED = "closed"  # pin released, history forgotten (terminal)


_TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    SessionState.IDLE: frozenset({SessionState.GENERATING, SessionState.DETACHED, SessionState.CLOSED}),
    SessionState.GENERATING: frozenset({SessionState.IDLE}),
    SessionState.DETACHED: frozenset({SessionState.IDLE, SessionState.CLOSED}),
    SessionState.CLOSED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A session was asked to move along an edge the lifecycle does not have (a server bug)."""


@dataclass(slots=True)
class Session:
    """One conversation (a chain).

    Attributes:
        session_id: unguessable (it is the capability to resume); the engine's
            pin key for the chain's blocks.
        history: prompt ids of the last turn plus the ids generated for
            sample 0; the next turn's prompt starts with exactly these.
        resumable: keep the session after its socket closes (until the TTL).
        last_active: monotonic seconds of the last state change.
        head: id of the chain's newest response (Responses API): the one
            response whose continuation adopts the pin; ``None`` elsewhere.
        system: the system prompt (``instructions``) the chain started with.
        alias: the client's name for the chain (the ``x-session-id`` header),
            looked up with :meth:`SessionRegistry.by_alias`.
        transcript: ``(role, content)`` of the messages ``history`` renders
            (``x-session-id`` chains: a request that repeats them continues
            from ``history`` without re-tokenizing).
    """

    session_id: str
    history: list[int] = field(default_factory=list)
    resumable: bool = False
    state: SessionState = SessionState.IDLE
    last_active: float = 0.0
    num_turns: int = 0
    head: str | None = None
    system: str | None = None
    alias: str | None = None
    transcript: list[tuple[str, str]] = field(default_factory=list)

    def transition(self, new: SessionState, now: float) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise IllegalTransition(f"session {self.session_id}: cannot go from {self.state.value} to {new.value}")
        self.state = new
        self.last_active = now


class SessionRegistry:
    """All live sessions of one server; event-loop only (not thread-safe).

    Args:
        release_fn: drops the engine's pin (``engine.release_session``).
        ttl: seconds a detached session waits for a resume before release.
        max_sweep: most sessions one sweep releases (keeps each sweep short).
        max_sessions: most live sessions (``None``: no cap); see :meth:`create`.
        replica: this replica's name under Ray Serve; then the resume of a
            session id it does not hold is ``session_lost`` (see :meth:`resume`).
    """

    def __init__(
        self,
        release_fn: Callable[[str], None],
        ttl: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_sweep: int = 256,
        max_sessions: int | None = None,
        replica: str | None = None,
    ) -> None:
        self.replica = replica
        self._release_fn = release_fn
        self.ttl = ttl
        self._clock = clock
        self._max_sweep = max_sweep
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        # Detached sessions in detach order, hence in expiry order.
        self._detached: OrderedDict[str, Session] = OrderedDict()
        self._aliases: dict[str, Session] = {}  # x-session-id -> its chain

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    @property
    def num_detached(self) -> int:
        return len(self._detached)

    def by_alias(self, alias: str) -> Session | None:
        """The live chain a client named ``alias`` (``x-session-id``), if any."""
        return self._aliases.get(alias)

    def create(self, *, resumable: bool = False, alias: str | None = None, session_id: str | None = None) -> Session:
        """A new attached session; at ``max_sessions``, the longest-detached session is released first.

        ``alias`` names it for :meth:`by_alias`; a live chain of that alias is released first.
        ``session_id`` is the client's own id (matching :data:`CLIENT_SESSION_ID`),
        else a random one is drawn.

        Raises:
            EngineError: ``invalid_params`` for a malformed ``session_id``,
                ``session_busy`` for one that is live already.
            EngineError: ``too_many_sessions`` when at ``max_sessions`` and no
                session is detached (each one is held by a socket).
        """
        if self.max_sessions is not None and len(self._sessions) >= self.max_sessions:
            if not self._detached:
                raise EngineError(
                    ErrorCode.TOO_MANY_SESSIONS,
                    f"the server holds its maximum of {self.max_sessions} sessions, all in use; try again later",
                )
            oldest = next(iter(self._detached.values()))
            logger.info("max_sessions (%d) reached: evicting the longest-detached session", self.max_sessions)
            self.release(oldest)
        if session_id is not None and not CLIENT_SESSION_ID.match(session_id):
            raise EngineError(ErrorCode.INVALID_PARAMS, "session_id: 16 to 128 characters of A-Z a-z 0-9 . _ : -")
        if session_id is not None and session_id in self._sessions:
            raise EngineError(ErrorCode.SESSION_BUSY, f"session {session_id!r} is live already")
        if alias is not None and alias in self._aliases:
            self.release(self._aliases[alias])
        session = Session(
            session_id or secrets.token_urlsafe(16), resumable=resumable, last_active=self._clock(), alias=alias
        )
        self._sessions[session.session_id] = session
        if alias is not None:
            self._aliases[alias] = session
        return session

    def acquire(self, session: Session) -> bool:
        """Start a turn on a chain that no socket holds (Responses, ``x-session-id``): -> GENERATING.

        A detached chain is resumed first (a chain past its TTL is released).
        Returns ``False``, changing nothing, when the chain is closed, expired
        or has a turn in flight; the caller then starts a new chain.
        """
        if session.state is SessionState.DETACHED:
            if self._expired(session):
                self.release(session)
                return False
            del self._detached[session.session_id]
            session.transition(SessionState.IDLE, self._clock())
        if session.state is not SessionState.IDLE:
            return False
        session.transition(SessionState.GENERATING, self._clock())
        return True

    def end_turn(self, session: Session) -> None:
        """End a turn started by :meth:`acquire`; the chain stays attached to its caller (IDLE)."""
        if session.state is SessionState.GENERATING:
            session.transition(SessionState.IDLE, self._clock())

    def park(self, session: Session, *, keep: bool) -> None:
        """End a turn started by :meth:`acquire`: detach the chain (``keep``: until the TTL) or release it."""
        self.end_turn(session)
        session.resumable = keep
        self.detach(session)

    def resume(self, session_id: str) -> Session:
        """Attach a detached session to a new socket.

        Raises:
            EngineError: ``unknown_session`` (never existed, released or
                expired), ``session_busy`` (another socket holds it). Under Ray
                Serve (``replica`` set) an id this replica does not hold is
                ``session_lost`` instead: it may have lived on a replica that
                died, and one replica cannot tell that from an expired id.
        """
        session = self._sessions.get(session_id)
        if session is not None and session.state is SessionState.DETACHED and self._expired(session):
            self.release(session)
            session = None
        if session is None and self.replica is not None:
            raise EngineError(
                ErrorCode.SESSION_LOST,
                f"session {session_id!r} is not held by replica {self.replica} (its replica stopped, or it expired); "
                "start a new session and resend the history",
            )
        if session is None:
            raise EngineError(ErrorCode.UNKNOWN_SESSION, f"session {session_id!r} is unknown or has expired")
        if session.state is not SessionState.DETACHED:
            raise EngineError(ErrorCode.SESSION_BUSY, f"session {session_id!r} is attached to another connection")
        del self._detached[session_id]
        session.transition(SessionState.IDLE, self._clock())
        return session

    def detach(self, session: Session) -> None:
        """The session's socket closed: keep it for a resume if resumable, else release it."""
        if not session.resumable:
            self.release(session)
            return
        session.transition(SessionState.DETACHED, self._clock())
        self._detached[session.session_id] = session

    def release(self, session: Session) -> None:
        """Forget the session and drop its pin (idempotent)."""
        if session.state is SessionState.CLOSED:
            return
        session.transition(SessionState.CLOSED, self._clock())
        self._sessions.pop(session.session_id, None)
        self._detached.pop(session.session_id, None)
        if session.alias is not None and self._aliases.get(session.alias) is session:
            del self._aliases[session.alias]
        session.history = []
        session.transcript = []
        try:
            self._release_fn(session.session_id)
        except Exception:
            logger.exception("engine.release_session(%s) failed", session.session_id)

    def sweep(self) -> int:
        """Release up to ``max_sweep`` detached sessions idle past the TTL; returns how many."""
        released = 0
        while self._detached and released < self._max_sweep:
            session = next(iter(self._detached.values()))
            if not self._expired(session):
                break
            self.release(session)
            released += 1
        return released

    def close_all(self, release: bool = True) -> None:
        """Shutdown: release every session that no socket holds (attached ones close with their socket).

        ``release=False`` forgets them without dropping the engine's state
        (``--kv-offload-dir``: the engine saves them for a restart).
        """
        for session in list(self._detached.values()):
            if release:
                self.release(session)
            else:
                session.transition(SessionState.CLOSED, self._clock())
                self._sessions.pop(session.session_id, None)
                self._detached.pop(session.session_id, None)

    def restore(self, session_id: str, history: list[int]) -> Session:
        """Register a session saved before a restart as DETACHED (resumable, TTL from now).

        Raises:
            ValueError: the id is already live.
        """
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} is already live")
        now = self._clock()
        session = Session(session_id, list(history), resumable=True, state=SessionState.DETACHED, last_active=now)
        self._sessions[session_id] = session
        self._detached[session_id] = session
        return session

    async def run_sweeper(self) -> None:
        """Sweep forever at a quarter of the TTL (between 10 ms and 30 s); cancel to stop."""
        interval = min(max(self.ttl / 4.0, 0.01), 30.0)
        while True:
            await asyncio.sleep(interval)
            while self.sweep() == self._max_sweep:
                await asyncio.sleep(0)  # more have expired: next batch after other work

    def _expired(self, session: Session) -> bool:
        return self._clock() - session.last_active > self.ttl


def chained_prompt(
    chat: ChatFormatterLike, eos_token_ids: tuple[int, ...], history: list[int], user: str, system: str | None = None
) -> list[int]:
    """Prompt ids of a chain's next turn: the template of (system, user) on an empty chain, else
    ``history`` + the template fragment of one more user turn (history is never re-tokenized).

    Runs the tokenizer: call it off the event loop.
    """
    if not history:
        return list(chat.first_turn(user, system))
    return history + list(chat.next_turn(user, history[-1] in eos_token_ids))
