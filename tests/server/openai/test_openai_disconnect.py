"""A client that drops the HTTP connection mid-answer aborts its request: blocks back, running 0."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai_helpers import build_engine
from server_harness import RunningServer, make_server, wait_for

from streamkv.config import ServerConfig
from streamkv.model.loader import LoadedModel

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

MAX_TOKENS = 1900  # the tiny model is fast: a long answer is still running when the client hangs up


@pytest.fixture(scope="module")
def long_server(tiny_model_dir: str, tiny: LoadedModel) -> Iterator[RunningServer]:
    engine, metrics = build_engine(tiny_model_dir, tiny, max_model_len=2048, num_blocks=160)
    with make_server(engine, metrics=metrics, server_config=ServerConfig(served_model_name="tiny")) as srv:
        yield srv


def stats(srv: RunningServer) -> dict[str, Any]:
    return srv.get("/api/stats").json()


def wait_idle(srv: RunningServer) -> dict[str, Any]:
    def idle() -> bool:
        snap = stats(srv)
        counts = snap["counts"]
        return snap["requests"]["running"] == 0 and counts["used"] == counts["shared"] == counts["pinned"] == 0

    wait_for(idle, timeout=30, what="running 0 and every block back in the pool")
    return stats(srv)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_dropped_after_3_chunks_is_aborted(long_server: RunningServer, path: str) -> None:
    before = wait_idle(long_server)
    body: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                            "extra": "ignored"}  # fmt: skip
    if path == "/v1/completions":
        body["prompt"] = "Tell me a very long story about a dragon."
    else:
        body["messages"] = [{"role": "user", "content": "Tell me a very long story about a dragon."}]
    events = []
    with httpx.stream("POST", long_server.http_url + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 3:
                running = stats(long_server)["requests"]["running"]
                break  # closing the line iterator closes the connection (httpcore drops it mid-body)
    assert running == 1  # it was still generating when we hung up
    after = wait_idle(long_server)
    assert after["finished"]["cancelled"] == before["finished"]["cancelled"] + 1
    generated = after["counters"]["generation_tokens"] - before["counters"]["generation_tokens"]
    assert generated < MAX_TOKENS, generated  # stopped early, not run to max_tokens


def test_non_streamed_request_dropped_is_aborted(long_server: RunningServer) -> None:
    before = wait_idle(long_server)
    body = {"model": "tiny", "prompt": "Tell me a very long story.", "max_tokens": MAX_TOKENS, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(long_server.http_url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    after = wait_idle(long_server)
    assert after["finished"]["cancelled"] == before["finished"]["cancelled"] + 1
    assert after["counters"]["generation_tokens"] - before["counters"]["generation_tokens"] < MAX_TOKENS
