"""Shared by the Responses API tests: a server per test module, and reading one response off a socket."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
from openai.types.responses import ResponsesServerEvent
from openai_helpers import build_engine
from pydantic import TypeAdapter
from server_harness import RunningServer, make_server

from streamkv.config import ServerConfig
from streamkv.model.loader import LoadedModel

# Strict validation of every server event against the SDK's own types (its parser does not validate).
SERVER_EVENT: TypeAdapter[Any] = TypeAdapter(ResponsesServerEvent)
FINAL = {"response.completed", "response.incomplete", "error"}
OPENING = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@contextmanager
def responses_server(tiny_model_dir: str, tiny: LoadedModel, **server: Any):  # type: ignore[no-untyped-def]
    engine, metrics = build_engine(tiny_model_dir, tiny, max_model_len=1024, num_blocks=192)
    config = ServerConfig(stats_interval=0.05, served_model_name="tiny", **server)
    with make_server(engine, metrics=metrics, server_config=config) as srv:
        yield srv


def client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@dataclass
class Reply:
    """One response as read off a socket."""

    events: list[Any] = field(default_factory=list)

    @property
    def final(self) -> Any:
        return self.events[-1]

    @property
    def response(self) -> Any:
        return self.final.response

    @property
    def text(self) -> str:
        return "".join(e.delta for e in self.events if e.type == "response.output_text.delta")

    @property
    def types(self) -> list[str]:
        return [e.type for e in self.events]


def read_reply(conn: Any, stream_id: str | None = None, timeout: float = 120.0) -> Reply:
    """Events of one lane up to its final event; every event is validated against the SDK's types."""
    reply = Reply()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        raw = conn.recv_bytes()
        SERVER_EVENT.validate_json(raw)
        event = conn.parse_event(raw)
        if getattr(event, "stream_id", None) != stream_id:
            raise AssertionError(f"event of lane {event.stream_id!r} while reading lane {stream_id!r}")
        reply.events.append(event)
        if event.type in FINAL:
            return reply
    raise TimeoutError(f"no final event within {timeout} s")


def block_counts(srv: RunningServer) -> dict[str, int]:
    counts: dict[str, int] = httpx.get(srv.http_url + "/api/stats", timeout=10).json()["counts"]
    return counts


def held_blocks(srv: RunningServer) -> int:
    counts = block_counts(srv)
    return counts["used"] + counts["pinned"] + counts["shared"]


def metric(srv: RunningServer, name: str) -> float:
    for line in httpx.get(srv.http_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def create_response(conn: Any, text: str, params: dict[str, Any], previous: str | None = None) -> Any:
    """Send a raw ``response.create`` (the SDK's create() has no ``ignore_eos``, vLLM's extension) and
    return its response once completed or incomplete."""
    previous_id = {"previous_response_id": previous} if previous else {}
    conn.send({"type": "response.create", "input": text, **params, **previous_id})
    reply = read_reply(conn)
    assert reply.final.type in ("response.completed", "response.incomplete"), reply.final
    return reply.response
