"""The Ray Serve pieces that need no Ray: client-named sessions, session_lost, the replica label and header.

These run without ray installed (tests/test_ray_serve.py runs the real deployment).
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from streamkv.config import ServerConfig
from streamkv.errors import EngineError
from streamkv.metrics import EngineMetrics
from streamkv.server.cli import build_parser
from streamkv.server.ray_app import REPLICA_HEADER, RayServeConfig, ReplicaHeader, asgi_get_status, ray_config
from streamkv.server.sessions import SessionRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent / "server"))  # the uvicorn harness and the fake engine
from fake_engine import FakeEngine  # noqa: E402
from server_harness import chat_turn, make_server  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

pytestmark = pytest.mark.timeout(60)
CLIENT_ID = "client-chosen-id-0123456789"


# ------------------------------------------------------------------ sessions


def test_a_session_can_take_the_clients_id_and_bad_ids_are_refused() -> None:
    released: list[str] = []
    sessions = SessionRegistry(released.append, ttl=60)
    session = sessions.create(session_id=CLIENT_ID)
    assert session.session_id == CLIENT_ID and sessions.get(CLIENT_ID) is session
    with pytest.raises(EngineError) as busy:
        sessions.create(session_id=CLIENT_ID)
    assert busy.value.code == "session_busy"
    for bad in ("short", "x" * 129, "has space in it 0123", "slash/0123456789abcdef"):
        with pytest.raises(EngineError) as e:
            sessions.create(session_id=bad)
        assert e.value.code == "invalid_params", bad
    assert len(sessions) == 1 and released == []


def test_under_ray_a_session_this_replica_does_not_hold_is_session_lost() -> None:
    single = SessionRegistry(lambda _sid: None, ttl=60)
    with pytest.raises(EngineError) as unknown:
        single.resume(CLIENT_ID)
    assert unknown.value.code == "unknown_session"

    replica = SessionRegistry(lambda _sid: None, ttl=60, replica="abc123")
    with pytest.raises(EngineError) as lost:
        replica.resume(CLIENT_ID)
    assert lost.value.code == "session_lost"
    assert "abc123" in lost.value.message and "resend the history" in lost.value.message
    held = replica.create(resumable=True)
    replica.detach(held)
    assert replica.resume(held.session_id) is held  # one it holds resumes as before


# ------------------------------------------------------------------ /ws/chat


def test_ws_chat_takes_the_session_id_from_the_url_or_the_header_and_resumes_it() -> None:
    engine = FakeEngine(metrics=EngineMetrics())
    with make_server(engine) as srv:
        with connect(srv.ws_url(f"/ws/chat?session_id={CLIENT_ID}"), open_timeout=5) as ws:
            t1 = chat_turn(ws, "hello", resumable=True, params={"max_tokens": 3})
        assert t1.session_id == CLIENT_ID and t1.done is not None
        assert t1.frames[0]["resumed"] is False
        # The header names it too (what Ray Serve routes on); no session_id in the frame: resumed.
        with connect(srv.ws_url(), additional_headers={"x-session-id": CLIENT_ID}, open_timeout=5) as ws:
            t2 = chat_turn(ws, "more", params={"max_tokens": 3})
        assert t2.frames[0]["type"] == "session" and t2.frames[0]["resumed"] is True, t2.frames
        assert t2.frames[0]["num_turns"] == 1 and t2.done is not None
        assert engine.requests[1].session_id == CLIENT_ID
        # A malformed id is refused like any bad field, and the socket carries on.
        with connect(srv.ws_url("/ws/chat?session_id=short"), open_timeout=5) as ws:
            bad = chat_turn(ws, "hi", params={"max_tokens": 3})
            assert bad.error is not None and bad.error["code"] == "invalid_params"


# ------------------------------------------------------------------ metrics


def test_the_replica_label_is_on_every_series_only_under_ray() -> None:
    plain, _ = EngineMetrics().render()
    assert b"replica=" not in plain
    labelled, _ = EngineMetrics(const_labels={"replica": "abc123"}).render()
    samples = [line for line in labelled.decode().splitlines() if line and not line.startswith("#")]
    assert samples and all('replica="abc123"' in line for line in samples)
    # the same series otherwise: names and other labels unchanged
    strip = re.compile(r',replica="abc123"|replica="abc123",?')
    unlabelled = [strip.sub("", line).replace("{}", "") for line in samples]
    assert unlabelled == [line for line in plain.decode().splitlines() if line and not line.startswith("#")]


# ------------------------------------------------------------------ ASGI pieces


def _app(status: int) -> Starlette:
    async def healthz(request: Request) -> PlainTextResponse:
        return PlainTextResponse("x", status_code=status)

    return Starlette(routes=[Route("/healthz", healthz)])


def test_health_check_reads_the_apps_own_healthz_and_the_header_names_the_replica() -> None:
    assert asyncio.run(asgi_get_status(_app(200), "/healthz")) == 200
    assert asyncio.run(asgi_get_status(_app(503), "/healthz")) == 503

    sent: list[dict[str, object]] = []

    async def call() -> None:
        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": "/healthz", "headers": [], "query_string": b""}
        await ReplicaHeader(_app(200), "abc123")(scope, receive, send)  # type: ignore[arg-type]

    asyncio.run(call())
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert (REPLICA_HEADER.encode(), b"abc123") in start["headers"]  # type: ignore[operator]


# ------------------------------------------------------------------ flags


def test_ray_flags_build_the_layout_and_bad_ones_name_the_field() -> None:
    args = build_parser().parse_args(["serve", "--ray", "--replicas", "3", "--threads", "2", "--device", "cuda"])
    layout = ray_config(args)
    assert (layout.replicas, layout.num_cpus, layout.num_gpus, layout.router) == (3, 2.0, 1.0, "session")
    args = build_parser().parse_args(["serve", "--ray", "--ray-router", "default"])
    assert ray_config(args) == RayServeConfig(router="default")
    with pytest.raises(ValueError, match="replicas"):
        ray_config(build_parser().parse_args(["serve", "--ray", "--replicas", "0"]))
    with pytest.raises(ValueError, match="replica"):
        ServerConfig(replica="")
