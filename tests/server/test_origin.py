"""The Origin check (origin.py): unit cases, then handshakes against a real uvicorn server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from server_harness import RunningServer, chat_turn, make_server
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from streamkv.config import ServerConfig
from streamkv.metrics import EngineMetrics
from streamkv.server.origin import OriginPolicy, normalize_origin

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("origin", "want"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("HTTP://Example.COM:80", "http://example.com"),
        ("https://example.com:443", "https://example.com"),
        ("https://example.com:8443", "https://example.com:8443"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("null", None),
        ("file://", None),
        ("http://host:notaport", None),
    ],
)
def test_normalize_origin(origin: str, want: str | None) -> None:
    assert normalize_origin(origin) == want


@pytest.mark.parametrize(
    ("allowed", "origin", "host", "ok"),
    [
        ((), None, "127.0.0.1:8000", True),  # no Origin: not a browser page
        ((), "http://127.0.0.1:8000", "127.0.0.1:8000", True),  # same origin
        ((), "http://localhost:8000", "localhost:8000", True),
        ((), "http://example.com", "example.com:80", True),  # default port either way
        ((), "http://evil.example", "127.0.0.1:8000", False),  # cross-site page
        ((), "http://127.0.0.1:9999", "127.0.0.1:8000", False),  # another local port is another origin
        ((), "http://localhost:8000", "127.0.0.1:8000", False),
        ((), "null", "127.0.0.1:8000", False),
        ((), "http://127.0.0.1:8000", None, False),
        (("https://app.example.com",), "https://app.example.com", "127.0.0.1:8000", True),
        (("https://app.example.com",), "https://app.example.com:444", "127.0.0.1:8000", False),
        (("https://app.example.com", "http://other:81"), "http://OTHER:81", "127.0.0.1:8000", True),
        (("*",), "http://evil.example", "127.0.0.1:8000", True),
        (("*",), "null", "127.0.0.1:8000", True),
    ],
)
def test_policy(allowed: tuple[str, ...], origin: str | None, host: str | None, ok: bool) -> None:
    assert OriginPolicy(allowed).permits(origin, host) is ok


@pytest.mark.parametrize("entry", ["example.com", "https://example.com/path", "ftp://example.com", "null"])
def test_policy_refuses_entries_that_are_not_origins(entry: str) -> None:
    with pytest.raises(ValueError, match="not an origin"):
        OriginPolicy([entry])


def open_ws(srv: RunningServer, path: str, origin: str | None) -> ClientConnection:
    return connect(srv.ws_url(path), origin=origin, open_timeout=5, close_timeout=2)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["/ws/chat", "/ws/stats"])
def test_cross_site_handshake_gets_403(server: RunningServer, engine: FakeEngine, path: str) -> None:
    with pytest.raises(InvalidStatus) as info:
        open_ws(server, path, "http://evil.example")
    assert info.value.response.status_code == 403
    assert not engine.requests
    body = server.get("/metrics").text
    assert "streamkv_rejected_origins_total 1.0" in body


def test_same_origin_and_originless_handshakes_connect(server: RunningServer) -> None:
    same = f"http://{server.host}:{server.port}"
    for origin in (same, None):
        with open_ws(server, "/ws/chat", origin) as ws:
            assert chat_turn(ws, "hi", params={"max_tokens": 2}).done is not None


@pytest.fixture
def open_server(engine: FakeEngine, metrics: EngineMetrics) -> Iterator[RunningServer]:
    config = ServerConfig(allowed_origins=("https://app.example.com",))
    with make_server(engine, metrics=metrics, server_config=config) as srv:
        yield srv


def test_allowed_origins_are_let_in(open_server: RunningServer) -> None:
    with open_ws(open_server, "/ws/chat", "https://app.example.com") as ws:
        assert chat_turn(ws, "hi", params={"max_tokens": 2}).done is not None
    with pytest.raises(InvalidStatus):
        open_ws(open_server, "/ws/chat", "https://evil.example.com")
