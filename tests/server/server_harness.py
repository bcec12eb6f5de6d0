"""Run the real app under uvicorn in a background thread, and talk to it.

``make_server(engine)`` works with any engine implementing the AsyncEngine
interface (the FakeEngine here, or the real one)::

    with make_server(engine) as srv:
        with connect_chat(srv) as ws:
            turn = chat_turn(ws, "hello", params={"max_tokens": 8})

Every wait is bounded; helpers raise ``TimeoutError`` instead of hanging.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from websockets.sync.client import ClientConnection, connect

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from streamkv.metrics import EngineMetrics
from streamkv.model.loader import LoadedModel
from streamkv.server.app import create_app
from streamkv.server.engine_api import ServingEngine
from streamkv.server.protocol import WS_MAX_SIZE


def build_engine(
    tiny_model_dir: str, tiny: LoadedModel, *, max_model_len: int, num_blocks: int, attention_backend: str = "auto"
) -> tuple[Any, EngineMetrics]:
    """A real :class:`AsyncEngine` on the tiny model (seed 0) and its metrics, for :func:`make_server`."""
    from streamkv.engine import AsyncEngine

    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu", seed=0, attention_backend=attention_backend),
        cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_model_len=max_model_len),
    )
    metrics = EngineMetrics()
    return AsyncEngine(config, metrics, loaded=tiny), metrics


@dataclass
class RunningServer:
    app: Starlette
    engine: Any
    metrics: EngineMetrics
    host: str
    port: int

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def ws_url(self, path: str = "/ws/chat") -> str:
        return f"ws://{self.host}:{self.port}{path}"

    def get(self, path: str, timeout: float = 5.0) -> httpx.Response:
        return httpx.get(self.http_url + path, timeout=timeout)


@contextmanager
def make_server(
    engine: ServingEngine,
    *,
    server_config: ServerConfig | None = None,
    metrics: EngineMetrics | None = None,
    web_dir: Path | None = None,
    startup_timeout_s: float = 30.0,
    shutdown_timeout_s: float = 10.0,
) -> Iterator[RunningServer]:
    """Serve ``create_app(engine, ...)`` on 127.0.0.1 and a free port; stop it on exit."""
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only when the
    # listening socket says TCP; with proto 0, Nagle + delayed ACKs add ~40 ms per frame.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    base = server_config or ServerConfig(stats_interval=0.05)
    config = dataclasses.replace(base, host="127.0.0.1", port=port)
    metrics = metrics or EngineMetrics()
    app = create_app(engine, config, metrics, web_dir=web_dir)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            ws="websockets-sansio",
            ws_max_size=WS_MAX_SIZE,
            lifespan="on",
            log_level="warning",
            timeout_graceful_shutdown=2,
        )
    )
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # surfaced to the test below
            errors.append(e)

    thread = threading.Thread(target=serve, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start within {startup_timeout_s} s: {errors!r}")
            time.sleep(0.01)
        yield RunningServer(app, engine, metrics, "127.0.0.1", port)
    finally:
        server.should_exit = True
        thread.join(timeout=shutdown_timeout_s)
        sock.close()
        if thread.is_alive():
            raise RuntimeError(f"server did not stop within {shutdown_timeout_s} s")
    if errors:
        raise errors[0]


# ------------------------------------------------------------------- client


def connect_chat(srv: RunningServer, path: str = "/ws/chat") -> ClientConnection:
    # max_queue=None: a test that stops reading mid-answer must still see the close handshake.
    return connect(srv.ws_url(path), open_timeout=5, close_timeout=2, max_size=WS_MAX_SIZE, max_queue=None)


def send_json(ws: ClientConnection, frame: dict[str, Any]) -> None:
    ws.send(orjson.dumps(frame).decode())


def recv_json(ws: ClientConnection, timeout: float = 5.0) -> dict[str, Any]:
    data = ws.recv(timeout=timeout)
    frame = orjson.loads(data)
    assert isinstance(frame, dict), frame
    return frame


def recv_until(ws: ClientConnection, types: set[str], timeout: float = 10.0) -> list[dict[str, Any]]:
    """Frames up to and including the first whose type is in ``types``."""
    deadline = time.monotonic() + timeout
    frames: list[dict[str, Any]] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {types} frame within {timeout} s; got {[f['type'] for f in frames]}")
        frames.append(recv_json(ws, timeout=left))
        if frames[-1]["type"] in types:
            return frames


@dataclass
class Turn:
    frames: list[dict[str, Any]]
    session_id: str | None = None
    text: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    done: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    @classmethod
    def from_frames(cls, frames: list[dict[str, Any]]) -> Turn:
        turn = cls(frames)
        for f in frames:
            if f["type"] == "session":
                turn.session_id = f["session_id"]
            elif f["type"] == "delta":
                turn.text[f["index"]] = turn.text.get(f["index"], "") + f["text"]
                turn.token_ids.setdefault(f["index"], []).extend(f["token_ids"])
            elif f["type"] == "done":
                turn.done = f
            elif f["type"] == "error":
                turn.error = f
        return turn


def chat_frame(content: str, **fields: Any) -> dict[str, Any]:
    return {"type": "chat", "content": content, **fields}


def chat_turn(ws: ClientConnection, content: str, timeout: float = 10.0, **fields: Any) -> Turn:
    """Send one chat frame and collect frames until its done (or error)."""
    send_json(ws, chat_frame(content, **fields))
    return Turn.from_frames(recv_until(ws, {"done", "error"}, timeout))


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(0.005)
