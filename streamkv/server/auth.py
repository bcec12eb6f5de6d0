"""API keys (``--api-key`` / ``STREAMKV_API_KEY``): an ASGI middleware in front of every route.

With a key set, every route needs ``Authorization: Bearer KEY``, except the
ones a probe or the browser needs before it can know the key: ``/healthz``,
``/metrics``, the web page ``/`` and its ``/static/`` files. So ``/v1/*``,
``/tokenize``, ``/detokenize``, ``/api/stats`` and both WebSockets are
covered. WebSockets also accept ``?api_key=KEY``, since browsers cannot set
headers on a WebSocket handshake.

A refused HTTP request gets 401 with an OpenAI-shaped error body; a refused
WebSocket is accepted and closed at once with code 1008 (policy violation),
which, unlike a refused handshake, a browser can tell apart from a server
that is down. Keys are compared with :func:`hmac.compare_digest`.
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from streamkv.server.openai.errors import error_response

OPEN_PATHS = frozenset({"/", "/healthz", "/metrics"})
OPEN_PREFIXES = ("/static/",)
WS_POLICY_VIOLATION = 1008


class APIKeyMiddleware:
    """Refuse requests without the API key (see the module docstring).

    Args:
        app: the wrapped ASGI app.
        api_key: the key; must not be empty.

    Raises:
        ValueError: an empty key.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.app = app
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or _is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = _bearer(scope)
        if given is None and scope["type"] == "websocket":
            given = _query_key(scope)
        if given is not None and hmac.compare_digest(given.encode("utf-8"), self._key):
            await self.app(scope, receive, send)
            return
        reason = "missing API key" if given is None else "invalid API key"
        if scope["type"] == "websocket":
            await _close_websocket(receive, send, reason)
            return
        message = (
            "missing API key: send 'Authorization: Bearer <key>'"
            if given is None
            else "invalid API key: the Authorization header does not carry this server's key"
        )
        response = error_response(401, message, "invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def _is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            header: str = value.decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
            return ""  # some other scheme: present, but not our key
    return None


def _query_key(scope: Scope) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
    return values[0] if values else None


async def _close_websocket(receive: Receive, send: Send, reason: str) -> None:
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.close", "code": WS_POLICY_VIOLATION, "reason": reason})
