"""Server-sent events: ``data: {json}\\n\\n`` per event, then ``data: [DONE]\\n\\n``.

:class:`SSEResponse` closes its event generator however the response ends
(finished, client gone, server shutting down), so the generator's ``finally``
aborts the engine requests behind it at the engine's next step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response over an async generator of encoded events.

    Starlette cancels the streaming task when the client disconnects (it
    listens for ``http.disconnect`` while streaming); the ``finally`` here
    then closes the generator explicitly rather than leaving it to the
    garbage collector.
    """

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
