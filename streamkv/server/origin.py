"""The Origin check on every WebSocket handshake (cross-site WebSocket hijacking).

Browsers let any page open a WebSocket to any host, 127.0.0.1 included, and
send the page's origin along; they do not apply CORS to it. So a page the
user visits could drive a local server. Only the server's own origin (the
Origin's host:port equals the Host header) and ``--allowed-origins`` may
connect; a handshake without an Origin header (curl, Python clients, the
terminal chat) is allowed, since no browser page sends one.

Refused handshakes get HTTP 403 (the ASGI server's answer to a close before
accept) and count in ``streamkv_rejected_origins``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from streamkv.metrics import EngineMetrics

logger = logging.getLogger(__name__)

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def normalize_origin(origin: str) -> str | None:
    """``"HTTP://Example.com:80"`` -> ``"http://example.com"``; ``None`` when not an origin (e.g. ``"null"``)."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"  # IPv6
    if port is None or port == _DEFAULT_PORTS[parts.scheme]:
        return f"{parts.scheme}://{host}"
    return f"{parts.scheme}://{host}:{port}"


def _host_port(netloc: str, scheme: str) -> str | None:
    """``host[:port]`` lowercased with the scheme's default port dropped."""
    origin = normalize_origin(f"{scheme}://{netloc}")
    return None if origin is None else origin.split("://", 1)[1]


class OriginPolicy:
    """Which origins may open a WebSocket.

    Args:
        allowed: origins allowed besides the server's own; ``"*"`` allows any.

    Raises:
        ValueError: an entry is not an origin (``scheme://host[:port]``, no path).
    """

    def __init__(self, allowed: Iterable[str] = ()) -> None:
        entries = [a.strip() for a in allowed if a.strip()]
        self.allow_any = "*" in entries
        self.allowed: set[str] = set()
        for entry in entries:
            if entry == "*":
                continue
            origin = normalize_origin(entry)
            if origin is None or urlsplit(entry).path not in ("", "/"):
                raise ValueError(f"allowed_origins: {entry!r} is not an origin like https://example.com:8443")
            self.allowed.add(origin)

    def permits(self, origin: str | None, host: str | None) -> bool:
        """May a handshake with this ``Origin`` header, sent to this ``Host`` header, connect?"""
        if origin is None or self.allow_any:
            return True
        normalized = normalize_origin(origin)
        if normalized is None:
            return False  # "null" (sandboxed frames, file://) or junk
        if normalized in self.allowed:
            return True
        scheme = normalized.split("://", 1)[0]
        return host is not None and _host_port(host, scheme) == normalized.split("://", 1)[1]


class OriginCheck:
    """ASGI middleware: refuse WebSocket handshakes whose Origin the policy does not permit."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy, metrics: EngineMetrics | None = None) -> None:
        self.app = app
        self.policy = policy
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            headers = dict(scope.get("headers") or [])
            origin = headers.get(b"origin")
            host = headers.get(b"host")
            origin_s = None if origin is None else origin.decode("latin-1")
            if not self.policy.permits(origin_s, None if host is None else host.decode("latin-1")):
                logger.info("refused a WebSocket to %s from origin %.200r", scope.get("path"), origin_s)
                if self.metrics is not None:
                    self.metrics.rejected_origins.inc()
                await receive()  # websocket.connect
                await send({"type": "websocket.close", "code": 1008})  # before accept: HTTP 403
                return
        await self.app(scope, receive, send)
