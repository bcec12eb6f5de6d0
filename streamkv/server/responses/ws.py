"""``GET /v1/responses`` upgraded to a WebSocket: the Responses API's WebSocket mode.

The client sends ``response.create`` events (the ``POST /v1/responses``
fields, plus ``stream_id``); the server answers with the same events a
streamed ``POST`` sends, each carrying its create's ``stream_id``. Creates
on one lane (``stream_id``; absent is a lane too) run first-in first-out;
different lanes run concurrently. A refused create gets an ``error`` event
``{type: "error", status, error: {type, code, message, param}}`` and the
socket stays open.

Bounds: ``MAX_LANES`` lanes per socket, ``MAX_QUEUED`` creates waiting per
lane, frames of at most ``protocol.MAX_FRAME_BYTES``, ``MAX_LOCAL_RESPONSES``
``store: false`` responses kept for the socket (least recently used dropped).

A socket that closes cancels its responses in flight (they are never stored
and never enter their chains) and releases the chains only it could name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson
from pydantic import ValidationError
from starlette.websockets import WebSocket

from streamkv.config import ServerConfig
from streamkv.errors import ErrorCode
from streamkv.metrics import EngineMetrics
from streamkv.server.limits import receive_or_idle
from streamkv.server.openai.errors import APIError, from_validation
from streamkv.server.protocol import MAX_FRAME_BYTES
from streamkv.server.responses.objects import ResponseDraft, error_event
from streamkv.server.responses.protocol import ResponseCreate
from streamkv.server.responses.runner import ResponseRunner
from streamkv.server.responses.store import ResponseStore
from streamkv.server.sessions import Session, SessionState
from streamkv.server.writer import FrameWriter

logger = logging.getLogger(__name__)

MAX_LANES = 16
MAX_QUEUED = 16
MAX_LOCAL_RESPONSES = 256
# Response events are not merged (each has its sequence number): room for a long answer per lane.
MAX_PENDING_FRAMES = 8192


def responses_ws_endpoint(
    runner: ResponseRunner, metrics: EngineMetrics, config: ServerConfig
) -> Callable[[WebSocket], Awaitable[None]]:
    async def endpoint(websocket: WebSocket) -> None:
        await websocket.accept()
        await ResponsesConnection(websocket, runner, metrics, config).run()

    return endpoint


@dataclass(slots=True)
class _Lane:
    queue: asyncio.Queue[ResponseCreate] = field(default_factory=lambda: asyncio.Queue(MAX_QUEUED))
    task: asyncio.Task[None] | None = None
    busy: bool = False


class ResponsesConnection:
    """One WebSocket-mode socket: reads ``response.create`` events, runs each lane in order."""

    def __init__(self, websocket: WebSocket, runner: ResponseRunner, metrics: EngineMetrics, config: ServerConfig):
        self._ws = websocket
        self._runner = runner
        self._metrics = metrics
        self._config = config
        self._writer = FrameWriter(websocket, max_pending=MAX_PENDING_FRAMES)
        self._lanes: dict[str | None, _Lane] = {}
        self._local = ResponseStore(runner.sessions, None, MAX_LOCAL_RESPONSES)
        self._chains: dict[str, Session] = {}  # chains this socket ran turns on, by session id

    async def run(self) -> None:
        self._writer.start()
        try:
            while not self._writer.overflowed:
                message = await receive_or_idle(self._ws, self._config.idle_timeout, self._busy, self._metrics)
                if message is None or message["type"] == "websocket.disconnect":
                    break
                data = message.get("text")
                if data is None:
                    data = message.get("bytes") or b""
                self._handle(data)
        finally:
            lanes = [lane.task for lane in self._lanes.values() if lane.task is not None]
            for task in lanes:
                task.cancel()
            await asyncio.gather(*lanes, return_exceptions=True)
            self._local.clear()
            for chain in self._chains.values():
                if chain.state is SessionState.IDLE:  # only this socket could name it (store: false)
                    self._runner.sessions.release(chain)
            await self._writer.aclose()

    def _busy(self) -> bool:
        return any(lane.busy or not lane.queue.empty() for lane in self._lanes.values())

    def _handle(self, data: str | bytes) -> None:
        if len(data) > MAX_FRAME_BYTES:
            self._error(400, ErrorCode.FRAME_TOO_LARGE, f"event exceeds the limit of {MAX_FRAME_BYTES} bytes")
            return
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            self._error(400, ErrorCode.INVALID_JSON, f"event is not valid JSON: {e}")
            return
        if not isinstance(obj, dict):
            self._error(400, ErrorCode.INVALID_JSON, "event must be a JSON object")
            return
        kind = obj.get("type")
        if kind != "response.create":
            shown = str(kind)[:64]
            self._error(400, ErrorCode.UNKNOWN_TYPE, f"unsupported event type {shown!r} (expected response.create)")
            return
        stream_id = obj.get("stream_id") if isinstance(obj.get("stream_id"), str) else None
        try:
            req = ResponseCreate.model_validate(obj)
        except ValidationError as e:
            err = from_validation(e)
            self._error(400, err.code, err.message, err.param, stream_id)
            return
        lane = self._lanes.get(req.stream_id)
        if lane is None:
            if len(self._lanes) >= MAX_LANES:
                self._error(400, "invalid_value", f"at most {MAX_LANES} lanes (stream_id) per connection",
                            "stream_id", req.stream_id)  # fmt: skip
                return
            lane = self._lanes[req.stream_id] = _Lane()
            lane.task = asyncio.create_task(self._run_lane(lane), name=f"responses-lane-{req.stream_id}")
        try:
            lane.queue.put_nowait(req)
        except asyncio.QueueFull:
            self._error(400, "invalid_value", f"at most {MAX_QUEUED} creates may wait on one lane",
                        "stream_id", req.stream_id)  # fmt: skip

    async def _run_lane(self, lane: _Lane) -> None:
        while True:
            req = await lane.queue.get()
            lane.busy = True
            try:
                await self._respond(req)
            finally:
                lane.busy = False

    async def _respond(self, req: ResponseCreate) -> None:
        runner = self._runner
        try:
            plan = await runner.plan(req, self._local)
        except APIError as e:
            self._error(e.status, e.code, e.message, e.param, req.stream_id)
            return
        if len(self._chains) >= 2 * MAX_LOCAL_RESPONSES:  # keep the live ones only
            self._chains = {k: c for k, c in self._chains.items() if c.state is not SessionState.CLOSED}
        self._chains[plan.chain.session_id] = plan.chain
        draft = ResponseDraft(req, runner.serving.model_id, stream_id=req.stream_id)
        try:
            await runner.run(req, plan, draft, self._writer.send, local=self._local)
        except APIError as e:
            self._error(e.status, e.code, e.message, e.param, req.stream_id)
        except Exception as e:
            logger.exception("response %s failed", draft.response_id)
            self._error(500, ErrorCode.INTERNAL_ERROR, f"internal error: {type(e).__name__}", None, req.stream_id)
        finally:
            runner.abandon(plan, local=self._local)

    def _error(
        self, status: int, code: str, message: str, param: str | None = None, stream_id: str | None = None
    ) -> None:
        if code in set(ErrorCode):
            self._metrics.count_error(ErrorCode(code))
        self._writer.send(error_event(status, code, message[:300], param, stream_id))
