"""``WS /ws/chat``: one chat session per socket, answers streamed as deltas.

The socket reader never waits for an answer: each turn runs as its own task,
so ``cancel``, ``reset`` and a disconnect are seen mid-answer. Every frame to
the client goes through the socket's FrameWriter, so a slow client never
holds up the engine. Frame formats: ``protocol.py`` and the README.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from starlette.websockets import WebSocket

from streamkv.config import ServerConfig
from streamkv.errors import EngineError, ErrorCode
from streamkv.metrics import EngineMetrics
from streamkv.outputs import FinishReason, RequestOutput, Usage
from streamkv.server import protocol
from streamkv.server.engine_api import ServingEngine
from streamkv.server.limits import check_stop_strings, receive_or_idle
from streamkv.server.protocol import CancelFrame, ChatFrame, ResetFrame
from streamkv.server.sessions import Session, SessionRegistry, SessionState, chained_prompt
from streamkv.server.writer import FrameWriter

logger = logging.getLogger(__name__)

# A cancelled turn only has to close its engine generator; if that takes
# longer, the session is let go when the turn does end.
CANCEL_TIMEOUT_S = 5.0


def chat_endpoint(
    engine: ServingEngine, sessions: SessionRegistry, metrics: EngineMetrics, config: ServerConfig | None = None
) -> Callable[[WebSocket], Awaitable[None]]:
    limits = config or ServerConfig()

    async def endpoint(websocket: WebSocket) -> None:
        await websocket.accept()
        await ChatConnection(websocket, engine, sessions, metrics, limits).run()

    return endpoint


@dataclass(slots=True)
class _Turn:
    """What one turn has streamed so far."""

    n: int
    token_ids: list[list[int]] = field(init=False)
    finish_reasons: dict[int, FinishReason] = field(default_factory=dict)
    ttft_s: float | None = None
    usage: Usage | None = None
    final: RequestOutput | None = None
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        self.token_ids = [[] for _ in range(self.n)]

    def reasons(self, cancelled: bool, max_tokens: int | None) -> list[FinishReason]:
        def default(i: int) -> FinishReason:
            if cancelled:
                return FinishReason.CANCELLED
            if max_tokens is not None and len(self.token_ids[i]) >= max_tokens:
                return FinishReason.LENGTH
            return FinishReason.STOP

        return [self.finish_reasons.get(i) or default(i) for i in range(self.n)]


class ChatConnection:
    """One ``/ws/chat`` socket: reads frames, runs at most one turn at a time."""

    def __init__(
        self,
        websocket: WebSocket,
        engine: ServingEngine,
        sessions: SessionRegistry,
        metrics: EngineMetrics,
        limits: ServerConfig | None = None,
    ) -> None:
        self._ws = websocket
        self._limits = limits or ServerConfig()
        self._engine = engine
        self._sessions = sessions
        self._metrics = metrics
        self._writer = FrameWriter(websocket)
        self.session: Session | None = None
        self._turn: asyncio.Task[None] | None = None
        self._closing = False  # the socket is gone: a turn cut short now was never seen
        # The id the handshake names (?session_id= from a browser, else the x-session-id header a
        # balancer routes on): a chat frame without session_id resumes it if held here, else starts it.
        self._named_id = websocket.query_params.get("session_id") or websocket.headers.get("x-session-id") or None

    async def run(self) -> None:
        self._writer.start()
        try:
            while not self._writer.overflowed:
                message = await receive_or_idle(self._ws, self._limits.idle_timeout, self._busy, self._metrics)
                if message is None or message["type"] == "websocket.disconnect":
                    break
                data = message.get("text")
                if data is None:
                    data = message.get("bytes") or b""
                try:
                    await self._dispatch(protocol.parse_frame(data))
                except EngineError as e:
                    self._send_error(e.code, e.message)
        finally:
            self._closing = True
            await self._stop_turn()
            if self.session is not None:
                self._let_go(self.session, release=False)
                self.session = None
            await self._writer.aclose()

    def _busy(self) -> bool:
        return self._turn is not None and not self._turn.done()

    # --------------------------------------------------------------- frames

    async def _dispatch(self, frame: protocol.ClientFrame) -> None:
        if isinstance(frame, ChatFrame):
            self._start_turn(frame)
        elif isinstance(frame, CancelFrame):
            await self._stop_turn()  # no turn in flight: nothing to do (it may have just ended)
        elif isinstance(frame, ResetFrame):
            await self._stop_turn()
            if self.session is not None:
                self._let_go(self.session, release=True)
                self.session = None
            self._writer.send(protocol.reset_frame())

    def _start_turn(self, frame: ChatFrame) -> None:
        if self._turn is not None and not self._turn.done():
            raise EngineError(
                ErrorCode.SESSION_BUSY, "a turn is already in flight; send cancel or wait for its done frame"
            )
        check_stop_strings(frame.params.stop, self._limits, self._metrics)
        session = self._attach(frame)
        if frame.resumable is not None:
            session.resumable = frame.resumable
        session.transition(SessionState.GENERATING, time.monotonic())
        self._turn = asyncio.create_task(self._run_turn(session, frame), name=f"turn-{session.session_id}")
        self._turn.add_done_callback(lambda _task: self._turn_never_ran(session, frame.params.n))

    def _turn_never_ran(self, session: Session, n: int) -> None:
        """A turn cancelled before its first step (chat and cancel in one burst) skipped its own cleanup."""
        if session.state is SessionState.GENERATING:
            session.transition(SessionState.IDLE, time.monotonic())
            self._writer.send(protocol.done_frame([FinishReason.CANCELLED] * n, Usage(0, 0, 0), None, 0.0))

    def _attach(self, frame: ChatFrame) -> Session:
        """The session this chat frame continues: this socket's, a resumed one, or a new one."""
        if self.session is not None:
            if frame.session_id is not None and frame.session_id != self.session.session_id:
                raise EngineError(
                    ErrorCode.INVALID_PARAMS,
                    "session_id: this connection already holds another session; "
                    "open a new connection to resume a different one",
                )
            return self.session
        resume_id = frame.session_id
        if resume_id is None and self._named_id is not None and self._sessions.get(self._named_id) is not None:
            resume_id = self._named_id
        if resume_id is not None:
            self.session = self._sessions.resume(resume_id)
            self._writer.send(
                protocol.session_frame(
                    self.session.session_id,
                    resumed=True,
                    num_turns=self.session.num_turns,
                    num_tokens=len(self.session.history),
                )
            )
        else:
            self.session = self._sessions.create(resumable=bool(frame.resumable), session_id=self._named_id)
            self._writer.send(protocol.session_frame(self.session.session_id, resumed=False))
        return self.session

    def _send_error(self, code: ErrorCode, message: str) -> None:
        self._metrics.count_error(code)
        self._writer.send(protocol.error_frame(code, message))

    # ---------------------------------------------------------------- turns

    async def _run_turn(self, session: Session, frame: ChatFrame) -> None:
        t0 = time.perf_counter()
        turn = _Turn(frame.params.n)
        prompt_ids: list[int] | None = None
        try:
            try:
                prompt_ids = await asyncio.to_thread(self._build_prompt, list(session.history), frame)
                await self._stream(prompt_ids, frame, session.session_id, turn)
            except asyncio.CancelledError:
                pass  # cancel, reset or disconnect: report what was generated
            except EngineError as e:
                self._send_error(e.code, e.message)  # rejected: history unchanged
                return
            except Exception as e:
                logger.exception("turn of session %s failed", session.session_id)
                self._send_error(ErrorCode.INTERNAL_ERROR, f"internal error: {type(e).__name__}")
                return
            cancelled = turn.final is None
            # A turn cut short by a disconnect never reached the client: the history
            # stays as it was (the pin's extra tail is dropped when the next turn
            # adopts it by longest common prefix). A turn the client cancelled keeps
            # what it streamed, since the user saw it.
            if prompt_ids is not None and not (cancelled and self._closing):
                session.history = prompt_ids + turn.token_ids[0]
                session.num_turns += 1
            usage = turn.usage or Usage(
                prompt_tokens=len(prompt_ids or ()),
                cached_tokens=turn.num_cached_tokens,
                completion_tokens=sum(len(ids) for ids in turn.token_ids),
            )
            total_s = turn.final.e2e_s if turn.final is not None and turn.final.e2e_s is not None else None
            self._writer.send(
                protocol.done_frame(
                    turn.reasons(cancelled, frame.params.max_tokens),
                    usage,
                    turn.ttft_s,
                    total_s if total_s is not None else time.perf_counter() - t0,
                )
            )
        finally:
            session.transition(SessionState.IDLE, time.monotonic())

    def _build_prompt(self, history: list[int], frame: ChatFrame) -> list[int]:
        """Turn 1: the chat template of (system, user); turn N: history + the next user turn."""
        return chained_prompt(self._engine.chat, self._engine.eos_token_ids, history, frame.content, frame.system)

    async def _stream(self, prompt_ids: list[int], frame: ChatFrame, session_id: str, turn: _Turn) -> None:
        outputs = self._engine.generate(prompt_ids, frame.params, session_id=session_id)
        try:
            async for out in outputs:
                for d in out.deltas:
                    if d.index >= turn.n:
                        continue
                    if d.token_ids or d.text:
                        self._writer.send(protocol.delta_frame(d.index, d.text, d.token_ids))
                    turn.token_ids[d.index].extend(d.token_ids)
                    if d.finish_reason is not None:
                        turn.finish_reasons[d.index] = d.finish_reason
                if out.ttft_s is not None:
                    turn.ttft_s = out.ttft_s
                if out.usage is not None:
                    turn.usage = out.usage
                if out.num_cached_tokens is not None:
                    turn.num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    turn.final = out
        finally:
            await _aclose(outputs)  # aborts the request if it is still running

    async def _stop_turn(self) -> None:
        """Cancel the turn in flight (if any) and wait, bounded, for it to report."""
        task = self._turn
        if task is None or task.done():
            return
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=CANCEL_TIMEOUT_S)
        if not done:
            logger.warning("turn %s did not stop within %.0f s of its cancel", task.get_name(), CANCEL_TIMEOUT_S)

    def _let_go(self, session: Session, *, release: bool) -> None:
        """Release (reset) or detach (socket closed) the session, once its turn has ended."""

        def act() -> None:
            if release:
                self._sessions.release(session)
            else:
                self._sessions.detach(session)

        if session.state is SessionState.GENERATING and self._turn is not None:
            self._turn.add_done_callback(lambda _task: act())
        else:
            act()


async def _aclose(outputs: AsyncIterator[RequestOutput]) -> None:
    aclose = getattr(outputs, "aclose", None)
    if aclose is not None:
        await aclose()
