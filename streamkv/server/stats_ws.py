"""``WS /ws/stats``: push the engine's pool snapshot every ``stats_interval`` seconds.

``?session_id=`` names the viewer's own session, the only one ``session_blocks``
lists (none without it; see ``streamkv.stats.snapshot_json``). A Responses
client, which knows its response ids and never its chain's session id, names
one with ``?response_id=`` instead: ``session_blocks`` then lists, under that
response id, its chain's blocks (the newest response of a chain) or the
blocks of the token prefix it names (an older one); see
:meth:`~streamkv.server.responses.store.ResponseStore.chain_view`. An unknown,
expired or deleted id, and another connection's ``store: false`` response,
get ``{}``, as an unknown session id does. Naming both is refused
(``/api/stats``: 400; ``/ws/stats``: closed with 1008). Sends are
coalesced by construction: the next snapshot is built only after the previous
send has completed, so a client that reads slowly (or not at all) gets fewer
snapshots, nothing queues up for it, and nobody else waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.websockets import WebSocket

from streamkv.cache.block import cdiv
from streamkv.server.engine_api import ServingEngine
from streamkv.server.responses.store import ChainView

logger = logging.getLogger(__name__)

WS_POLICY_VIOLATION = 1008

ChainViews = Callable[[str], ChainView | None]  # response id -> what it shows (ResponseStore.chain_view)


@dataclass(frozen=True, slots=True)
class Viewer:
    """Whose blocks a snapshot lists: the viewer's own session, or one of its responses (at most one)."""

    session_id: str | None = None
    response_id: str | None = None

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> Viewer:
        """From ``?session_id=`` / ``?response_id=`` (empty counts as absent).

        Raises:
            ValueError: both are given.
        """
        session_id = query.get("session_id") or None
        response_id = query.get("response_id") or None
        if session_id is not None and response_id is not None:
            raise ValueError("give session_id or response_id, not both")
        return cls(session_id, response_id)


async def viewer_snapshot(engine: ServingEngine, viewer: Viewer, chain_views: ChainViews | None) -> dict[str, Any]:
    """The engine's snapshot with ``session_blocks`` for ``viewer`` (call on the event loop).

    A response id is resolved here, on the loop (the response store is
    loop-only); the snapshot itself is built on a worker thread. Its
    ``session_blocks`` name the response id, never the chain's session id.
    """
    if viewer.response_id is None:
        return await asyncio.to_thread(engine.snapshot, viewer.session_id)
    view = chain_views(viewer.response_id) if chain_views is not None else None
    snap = await asyncio.to_thread(engine.snapshot, view.pin_key if view is not None else None)
    blocks: list[int] = next(iter(snap.get("session_blocks", {}).values()), [])
    if view is not None and view.num_tokens is not None:
        blocks = blocks[: cdiv(view.num_tokens, snap["block_size"])]
    snap["session_blocks"] = {viewer.response_id: blocks} if blocks else {}
    return snap


def stats_endpoint(
    engine: ServingEngine, interval: float, chain_views: ChainViews | None = None
) -> Callable[[WebSocket], Awaitable[None]]:
    """``/ws/stats``; ``chain_views`` resolves ``?response_id=`` (``None``: every response id shows nothing)."""

    async def endpoint(websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            viewer = Viewer.from_query(websocket.query_params)
        except ValueError as e:
            await websocket.close(code=WS_POLICY_VIOLATION, reason=str(e))
            return
        await push_stats(websocket, engine, interval, viewer, chain_views)

    return endpoint


async def push_stats(
    websocket: WebSocket,
    engine: ServingEngine,
    interval: float,
    viewer: Viewer,
    chain_views: ChainViews | None = None,
) -> None:
    """Send snapshots until the client goes away."""
    gone = asyncio.Event()
    drain = asyncio.create_task(_drain(websocket, gone), name="stats-drain")
    loop = asyncio.get_running_loop()
    try:
        while not gone.is_set():
            started = loop.time()
            # A snapshot of a big pool is real work (and may wait on the engine): not on the loop.
            try:
                snap = await viewer_snapshot(engine, viewer, chain_views)
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
