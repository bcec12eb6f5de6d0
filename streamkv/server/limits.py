"""Server-side bounds: open connections, silent sockets, stop strings.

- ``ConnectionLimit`` (ASGI middleware) caps open WebSockets plus HTTP
  requests in flight at ``--max-connections``: over the cap an HTTP request
  gets 503 and a WebSocket is accepted and closed at once with code 1013
  ("try again later"). ``/healthz`` and ``/metrics`` are exempt, so an
  overloaded server can still be watched. ``streamkv_open_connections{kind}``
  reports what is open.
- ``receive_or_idle`` closes a chat socket that sends nothing for
  ``--idle-timeout`` seconds while no turn is in flight.
- ``check_stop_strings`` applies ``--max-stop-strings`` and
  ``--max-stop-string-length``.

Every refusal counts in ``streamkv_limit_refusals{limit}``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from streamkv.config import ServerConfig
from streamkv.errors import EngineError, ErrorCode
from streamkv.metrics import EngineMetrics

logger = logging.getLogger(__name__)

EXEMPT_PATHS = frozenset({"/healthz", "/metrics"})
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_IDLE = 1000  # a normal closure: the client simply went quiet


class ConnectionLimit:
    """ASGI middleware counting open HTTP requests and WebSockets against ``max_connections``."""

    def __init__(self, app: ASGIApp, max_connections: int | None, metrics: EngineMetrics) -> None:
        self.app = app
        self.max_connections = max_connections
        self.metrics = metrics
        self.num_open = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope.get("path") in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        if self.max_connections is not None and self.num_open >= self.max_connections:
            self.metrics.limit_refusals.labels(limit="max_connections").inc()
            await _refuse(kind, receive, send, self.max_connections)
            return
        self.num_open += 1
        gauge = self.metrics.open_connections.labels(kind=kind)
        gauge.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_open -= 1
            gauge.dec()


async def _refuse(kind: str, receive: Receive, send: Send, cap: int) -> None:
    reason = f"server at --max-connections ({cap}); try again later"
    if kind == "http":
        body = reason.encode()
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"retry-after", b"1")],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return
    message: Message = await receive()  # websocket.connect
    if message["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.close", "code": CLOSE_TRY_AGAIN_LATER, "reason": reason})


async def receive_or_idle(
    websocket: WebSocket, idle_timeout: float, busy: Callable[[], bool], metrics: EngineMetrics
) -> Message | None:
    """The next ASGI message of ``websocket``, or ``None`` after closing it for idleness.

    Silence only counts while ``busy()`` is false: a client waiting for its
    answer sends nothing, and that is fine. A window in which a turn was in
    flight at its start does not count either, so a socket always gets a
    full ``idle_timeout`` of silence after its last turn ends.
    """
    busy_at_start = busy()
    while True:
        try:
            return await asyncio.wait_for(websocket.receive(), idle_timeout)
        except TimeoutError:
            if busy() or busy_at_start:
                busy_at_start = busy()
                continue
            metrics.limit_refusals.labels(limit="idle_timeout").inc()
            logger.info("closing a chat socket silent for %.0f s", idle_timeout)
            await websocket.close(CLOSE_IDLE, f"idle for {idle_timeout:.0f} s")
            return None


def check_stop_strings(stop: Sequence[str], config: ServerConfig, metrics: EngineMetrics) -> None:
    """Refuse more than ``max_stop_strings`` stop strings, or one over ``max_stop_string_length`` chars.

    Raises:
        EngineError: ``invalid_params`` naming the bound.
    """
    if len(stop) > config.max_stop_strings:
        metrics.limit_refusals.labels(limit="max_stop_strings").inc()
        raise EngineError(
            ErrorCode.INVALID_PARAMS,
            f"params.stop: at most {config.max_stop_strings} stop strings (--max-stop-strings)",
        )
    longest = max((len(s) for s in stop), default=0)
    if longest > config.max_stop_string_length:
        metrics.limit_refusals.labels(limit="max_stop_string_length").inc()
        raise EngineError(
            ErrorCode.INVALID_PARAMS,
            f"params.stop: a stop string of {longest} characters is over the limit of "
            f"{config.max_stop_string_length} (--max-stop-string-length)",
        )
