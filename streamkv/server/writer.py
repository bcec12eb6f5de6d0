"""Per-socket frame writer: producers never await the client.

The turn task and the socket reader hand frames to ``FrameWriter.send``
(synchronous, never blocks); one task sends them in order. While a slow
client is still receiving, consecutive deltas of the same sample are merged
into one frame, so the backlog is bounded by the number of samples, not by
the length of the answer, and the engine's per-request queue keeps draining.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

import orjson
from starlette.websockets import WebSocket

logger = logging.getLogger(__name__)

Frame = dict[str, Any]


class FrameWriter:
    """Sends JSON text frames to one WebSocket from a single task.

    Args:
        websocket: an accepted socket.
        max_pending: most unsent non-mergeable frames; past it the client is
            not reading at all, ``overflowed`` turns true and further frames
            are dropped (the connection handler then closes the socket).
    """

    def __init__(self, websocket: WebSocket, *, max_pending: int = 256) -> None:
        self._ws = websocket
        self._max_pending = max_pending
        self._pending: deque[Frame] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.closed = False
        self.overflowed = False
        self.num_sent = 0
        self.num_merged = 0

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("FrameWriter already started")
        self._task = asyncio.create_task(self._run(), name="ws-frame-writer")

    def send(self, frame: Frame) -> None:
        """Queue ``frame``; deltas merge into a pending delta of the same sample index."""
        if self.closed or self.overflowed:
            return
        if frame.get("type") == "delta" and self._merge(frame):
            self.num_merged += 1
            return
        if len(self._pending) >= self._max_pending:
            self.overflowed = True
            self._pending.clear()
            logger.warning("client is not reading its frames; dropping its connection")
        else:
            self._pending.append(frame)
        self._wakeup.set()

    async def aclose(self) -> None:
        """Stop sending; frames still pending are dropped (the client is gone)."""
        self.closed = True
        self._pending.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # ------------------------------------------------------------- internals

    def _merge(self, frame: Frame) -> bool:
        # Only across the trailing run of deltas: a delta never jumps ahead
        # of a non-delta frame (a done or error) queued before it.
        for pending in reversed(self._pending):
            if pending.get("type") != "delta":
                return False
            if pending["index"] == frame["index"]:
                pending["text"] += frame["text"]
                pending["token_ids"].extend(frame["token_ids"])
                return True
        return False

    async def _run(self) -> None:
        while True:
            while not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            frame = self._pending.popleft()
            try:
                await self._ws.send_text(orjson.dumps(frame).decode())
            except Exception as e:  # the client went away; the reader sees the disconnect
                logger.debug("websocket send failed: %r", e)
                self.closed = True
                self._pending.clear()
                return
            self.num_sent += 1
