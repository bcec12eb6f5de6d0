"""Server bounds (limits.py) and error-frame hygiene, against a FakeEngine behind real uvicorn."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest
from fake_engine import FakeEngine
from server_harness import RunningServer, chat_turn, connect_chat, make_server, recv_json, send_json, wait_for
from websockets.exceptions import ConnectionClosed

from streamkv.config import ServerConfig
from streamkv.metrics import EngineMetrics
from streamkv.server.protocol import MAX_FRAME_BYTES

pytestmark = pytest.mark.timeout(60)


def scrape(srv: RunningServer) -> str:
    return srv.get("/metrics").text


def sample(body: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    key = f"{name}{{{want}}}" if labels else name
    for line in body.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{key} not in /metrics")


@pytest.fixture
def capped(engine: FakeEngine, metrics: EngineMetrics) -> Iterator[RunningServer]:
    with make_server(engine, metrics=metrics, server_config=ServerConfig(max_connections=2)) as srv:
        yield srv


def closed_code(ws) -> int | None:  # type: ignore[no-untyped-def]
    try:
        ws.recv(timeout=5)
    except ConnectionClosed as e:
        return e.rcvd.code if e.rcvd is not None else None
    raise AssertionError("the socket stayed open")


def test_max_connections_refuses_websocket_with_1013_and_http_with_503(capped: RunningServer) -> None:
    with connect_chat(capped) as a, connect_chat(capped) as b:
        wait_for(lambda: sample(scrape(capped), "streamkv_open_connections", kind="websocket") == 2, what="2 open")
        with connect_chat(capped) as c:
            assert closed_code(c) == 1013
        refused = httpx.get(capped.http_url + "/api/stats", timeout=5)
        assert refused.status_code == 503 and "max-connections" in refused.text
        # monitoring still works when full
        assert capped.get("/healthz").status_code == 200
        body = scrape(capped)
        assert sample(body, "streamkv_limit_refusals_total", limit="max_connections") == 2
        # the open sockets are unaffected
        assert chat_turn(a, "hi", params={"max_tokens": 2}).done is not None
        assert chat_turn(b, "hi", params={"max_tokens": 2}).done is not None
    wait_for(lambda: sample(scrape(capped), "streamkv_open_connections", kind="websocket") == 0, what="closed")
    with connect_chat(capped) as d:  # room again
        assert chat_turn(d, "hi", params={"max_tokens": 2}).done is not None


def test_silent_socket_is_closed_after_the_idle_timeout(engine: FakeEngine, metrics: EngineMetrics) -> None:
    with make_server(engine, metrics=metrics, server_config=ServerConfig(idle_timeout=0.5)) as srv:
        with connect_chat(srv) as quiet:
            t0 = time.monotonic()
            assert closed_code(quiet) == 1000
            assert 0.4 < time.monotonic() - t0 < 4.0
        # a socket waiting for its (slow) answer is not idle
        engine.token_delay = 0.1
        with connect_chat(srv) as busy:
            turn = chat_turn(busy, "hi", timeout=10, params={"max_tokens": 10})  # ~1 s of silence from the client
            assert turn.done is not None and turn.done["finish_reason"] == "length"
        assert sample(scrape(srv), "streamkv_limit_refusals_total", limit="idle_timeout") == 1


@pytest.mark.parametrize(
    ("stop", "limit", "word"),
    [
        (["s"] * 17, "max_stop_strings", "at most 16"),
        (["x" * 1025], "max_stop_string_length", "1025 characters"),
    ],
)
def test_stop_string_bounds(server: RunningServer, engine: FakeEngine, stop: list[str], limit: str, word: str) -> None:
    with connect_chat(server) as ws:
        turn = chat_turn(ws, "hi", params={"stop": stop})
        assert turn.error is not None and turn.error["code"] == "invalid_params" and word in turn.error["message"]
        assert not engine.requests  # refused before the engine saw it
        ok = chat_turn(ws, "hi", params={"stop": ["s"] * 16, "max_tokens": 2})
        assert ok.done is not None
    assert sample(scrape(server), "streamkv_limit_refusals_total", limit=limit) == 1


def test_stop_string_bounds_follow_the_config(engine: FakeEngine, metrics: EngineMetrics) -> None:
    config = ServerConfig(max_stop_strings=2, max_stop_string_length=4)
    with make_server(engine, metrics=metrics, server_config=config) as srv, connect_chat(srv) as ws:
        assert chat_turn(ws, "hi", params={"stop": ["a", "b", "c"]}).error is not None
        assert chat_turn(ws, "hi", params={"stop": ["abcde"]}).error is not None
        assert chat_turn(ws, "hi", params={"stop": ["abcd", "e"], "max_tokens": 1}).done is not None


def test_error_frames_do_not_echo_a_huge_session_id(server: RunningServer) -> None:
    session_id = "x" * (MAX_FRAME_BYTES - 100)
    with connect_chat(server) as ws:
        ws.send(orjson.dumps({"type": "chat", "content": "hi", "session_id": session_id}).decode())
        raw = ws.recv(timeout=10)
        frame = orjson.loads(raw)
        assert frame["code"] == "unknown_session"
        assert len(raw) < 1000 and frame["message"].endswith("\u2026")
        send_json(ws, {"type": "dance" * 100_000})
        frame = recv_json(ws)
        assert frame["code"] == "unknown_type" and len(frame["message"]) <= 300


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_invalid_utf8_text_frame_closes_with_1007_and_one_log_line(server: RunningServer) -> None:
    handler = _Records()
    uvicorn_error = logging.getLogger("uvicorn.error")
    uvicorn_error.addHandler(handler)
    try:
        with connect_chat(server) as ws:
            ws.send(b'{"type": "chat", "content": "\xff\xfe"}', text=True)
            assert closed_code(ws) == 1007
        with connect_chat(server) as ws:  # the server carries on
            assert chat_turn(ws, "hi", params={"max_tokens": 1}).done is not None
    finally:
        uvicorn_error.removeHandler(handler)
    utf8 = [r for r in handler.records if "UTF-8" in r.getMessage()]
    assert len(utf8) == 1, [r.getMessage() for r in handler.records]
    assert utf8[0].exc_info is None and "\n" not in handler.format(utf8[0])
