"""``WS /ws/stats``: push the engine's pool snapshot every ``stats_interval`` seconds.

``?session_id=`` names the viewer's own session, the only one ``session_blocks``
lists (none without it; see ``streamkv.stats.snapshot_json``). Sends are
coalesced by construction: the next snapshot is built only after the previous
send has completed, so a client that reads slowly (or not at all) gets fewer
snapshots, nothing queues up for it, and nobody else waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import orjson
from starlette.websockets import WebSocket

from streamkv.server.engine_api import ServingEngine

logger = logging.getLogger(__name__)


def stats_endpoint(engine: ServingEngine, interval: float) -> Callable[[WebSocket], Awaitable[None]]:
    async def endpoint(websocket: WebSocket) -> None:
        session_id = websocket.query_params.get("session_id") or None
        await websocket.accept()
        await push_stats(websocket, engine, interval, session_id)

    return endpoint


async def push_stats(websocket: WebSocket, engine: ServingEngine, interval: float, session_id: str | None) -> None:
    """Send snapshots until the client goes away."""
    gone = asyncio.Event()
    drain = asyncio.create_task(_drain(websocket, gone), name="stats-drain")
    loop = asyncio.get_running_loop()
    try:
        while not gone.is_set():
            started = loop.time()
            # A snapshot of a big pool is real work (and may wait on the engine): not on the loop.
            try:
                snap = await asyncio.to_thread(engine.snapshot, session_id)
            except Exception:
                logger.exception("stats snapshot failed; closing /ws/stats")
                await websocket.close(code=1011)
                return
            try:
                await websocket.send_text(orjson.dumps(snap).decode())
            except Exception as e:  # disconnected mid-send
                logger.debug("stats send failed: %r", e)
                return
            pause = interval - (loop.time() - started)
            if pause > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(gone.wait(), timeout=pause)
    finally:
        drain.cancel()
        await asyncio.gather(drain, return_exceptions=True)


async def _drain(websocket: WebSocket, gone: asyncio.Event) -> None:
    """Read (and ignore) client frames so that a close is noticed promptly."""
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
    except Exception as e:
        logger.debug("stats receive failed: %r", e)
    finally:
        gone.set()
