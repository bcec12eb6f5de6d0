"""/ws/stats: snapshots at the configured pace, and a client that never reads hurts nobody."""

from __future__ import annotations

import base64
import os
import socket
import time

import orjson
import pytest
from fake_engine import FakeEngine
from server_harness import RunningServer, chat_turn, connect_chat, make_server, wait_for
from websockets.exceptions import ConnectionClosed

from streamkv.config import ServerConfig

pytestmark = pytest.mark.timeout(30)


def test_snapshots_are_pushed_with_the_session_filter(server: RunningServer, engine: FakeEngine) -> None:
    with connect_chat(server) as chat:
        sid = chat_turn(chat, "hi", params={"max_tokens": 3}).session_id
        with connect_chat(server, f"/ws/stats?session_id={sid}") as stats:
            snaps = [orjson.loads(stats.recv(timeout=5)) for _ in range(3)]
    assert all(s["session_blocks"] and list(s["session_blocks"]) == [sid] for s in snaps)
    assert snaps[0]["num_blocks"] == 512 and len(base64.b64decode(snaps[0]["states"])) == 512
    assert snaps[-1]["t"] - snaps[0]["t"] >= 0.05  # interval 0.05 s, three snapshots
    assert engine.snapshot_calls_by_session[sid] >= 3


def test_stats_without_session(server: RunningServer) -> None:
    with connect_chat(server, "/ws/stats") as stats:
        snap = orjson.loads(stats.recv(timeout=5))
    assert snap["session_blocks"] == {} and snap["counts"]["free"] == 512


def open_silent_websocket(port: int, path: str) -> socket.socket:
    """A WebSocket client that completes the handshake and then never reads."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head and len(head) < 4096:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def test_a_client_that_never_reads_stalls_only_itself() -> None:
    # ~1.3 MB per snapshot at 100 Hz: unbounded queueing would be obvious.
    engine = FakeEngine(num_blocks=1_000_000)
    with make_server(engine, server_config=ServerConfig(stats_interval=0.01)) as srv:
        silent = open_silent_websocket(srv.port, "/ws/stats?session_id=silent")
        try:

            def calls() -> int:
                return engine.snapshot_calls_by_session.get("silent", 0)

            wait_for(lambda: calls() >= 1, what="first snapshot")
            time.sleep(0.5)  # socket buffers fill within a few snapshots
            stalled_at = calls()
            time.sleep(0.5)
            assert calls() - stalled_at <= 1, "a snapshot was built while the previous send was still pending"
            assert stalled_at < 30, stalled_at  # far below the 100 per second the interval asks for

            # Everybody else is unaffected.
            started = time.monotonic()
            with connect_chat(srv) as chat:
                turn = chat_turn(chat, "still there?", params={"max_tokens": 20})
            assert turn.done is not None and turn.done["usage"]["completion_tokens"] == 20
            assert srv.get("/healthz", timeout=2).status_code == 200
            with connect_chat(srv, "/ws/stats?session_id=reader") as reader:
                for _ in range(3):
                    assert orjson.loads(reader.recv(timeout=2))["num_blocks"] == 1_000_000
            assert time.monotonic() - started < 3.0
        finally:
            silent.close()


def test_a_failing_snapshot_closes_the_stats_socket(
    server: RunningServer, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def boom(session_id: str | None = None, include_blocks: bool = True) -> dict[str, object]:
        raise RuntimeError("engine gone")

    monkeypatch.setattr(engine, "snapshot", boom)
    with connect_chat(server, "/ws/stats") as stats, pytest.raises(ConnectionClosed) as info:
        stats.recv(timeout=5)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1011
    with connect_chat(server) as chat:  # chat is unaffected
        assert chat_turn(chat, "hi", params={"max_tokens": 1}).done is not None
