"""Two streamkv replicas on a local Ray Serve (``num_cpus=2``), routed by ``x-session-id``.

One test, bounded in time, on the tiny random model:

- every turn of a conversation reaches one replica: ``cached_tokens`` covers
  the previous prompt's full blocks each turn (a replica that had not seen
  the conversation would have only the shared template prefix cached);
- sessions with different ids spread over both replicas;
- a /ws/chat session resumes on its replica after a reconnect;
- killing that replica turns its resume into ``session_lost`` (not a hang,
  never another replica's state); new sessions and stateless requests carry on.

Skipped, with the reason in the summary, when ray[serve] is not installed
(``pip install 'streamkv[ray]'``).
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from websockets.exceptions import WebSocketException
from websockets.sync.client import connect

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig

ray = pytest.importorskip("ray", reason="ray[serve] is not installed: pip install 'streamkv[ray]' (docs/scaling.md)")
serve = pytest.importorskip("ray.serve")

from streamkv.server.ray_app import (  # noqa: E402
    APP_NAME,
    DEPLOYMENT_NAME,
    REPLICA_HEADER,
    RayServeConfig,
    build_application,
)

BLOCK_SIZE = 16
GREEDY = {"max_tokens": 8, "temperature": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_url(tiny_model_dir: str) -> Iterator[str]:
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine_config = EngineConfig(
            model=ModelConfig(model=tiny_model_dir, dtype="float32", device="cpu"),
            cache=CacheConfig(num_blocks=256),
            scheduler=SchedulerConfig(max_model_len=1024),
        )
        layout = RayServeConfig(replicas=2, num_cpus=1, health_check_period_s=1.0)
        app = build_application(engine_config, ServerConfig(session_ttl=60), layout, threads=1)
        serve.run(app, name=APP_NAME, route_prefix="/")
        yield f"127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _chat(client: httpx.Client, session_id: str, messages: list[dict[str, str]]) -> tuple[str, dict[str, Any]]:
    r = client.post("/v1/chat/completions", json={"messages": messages, **GREEDY}, headers={"x-session-id": session_id})
    assert r.status_code == 200, r.text
    return r.headers[REPLICA_HEADER], r.json()


def _ws_turn(url: str, session_id: str, frame: dict[str, Any], timeout: float = 30.0) -> tuple[str, list[Any]]:
    """One /ws/chat turn on a new socket routed by ``session_id``; (replica, frames up to done or error)."""
    with connect(f"ws://{url}/ws/chat", additional_headers={"x-session-id": session_id}, open_timeout=timeout) as ws:
        replica = ws.response.headers[REPLICA_HEADER]
        ws.send(orjson.dumps(frame).decode())
        frames = []
        deadline = time.monotonic() + timeout
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(orjson.loads(ws.recv(timeout=max(deadline - time.monotonic(), 0.01))))
        return replica, frames


@pytest.mark.timeout(420)
def test_sessions_stick_to_replicas_and_a_dead_replica_loses_only_its_sessions(ray_url: str) -> None:
    with httpx.Client(base_url=f"http://{ray_url}", timeout=60) as client:
        _check(client, ray_url)


def _check(client: httpx.Client, ray_url: str) -> None:

    # Every turn of a conversation on one replica; its history's full blocks come from that replica's cache.
    replica_of: dict[str, str] = {}
    for i in range(6):
        sid = f"conversation-{i}-{secrets.token_hex(8)}"
        messages = [{"role": "user", "content": f"Conversation {i}: " + " ".join(f"word{i}x{k}" for k in range(24))}]
        prev_prompt = 0
        for turn in range(3):
            replica, body = _chat(client, sid, messages)
            usage = body["usage"]
            if turn > 0:
                assert replica == replica_of[sid], f"{sid} moved from {replica_of[sid]} to {replica} on turn {turn}"
                assert usage["prompt_tokens_details"]["cached_tokens"] >= prev_prompt // BLOCK_SIZE * BLOCK_SIZE
            replica_of[sid] = replica
            prev_prompt = usage["prompt_tokens"]
            assert prev_prompt >= 4 * BLOCK_SIZE  # more than any prefix two conversations share
            messages += [
                {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"And then, {turn}?"},
            ]

    # Different session ids spread over both replicas (hash ring: 2 ** -20 chance of one side for 24 ids).
    for i in range(18):
        sid = f"spread-{i}-{secrets.token_hex(8)}"
        replica_of[sid] = _chat(client, sid, [{"role": "user", "content": "Hi"}])[0]
    assert len(set(replica_of.values())) == 2, replica_of

    metrics = client.get("/metrics").text
    assert any(f'replica="{name}"' in metrics for name in set(replica_of.values())), metrics[:500]

    # A resumable /ws/chat session: named by the handshake's x-session-id, resumed on the same replica.
    sid = secrets.token_urlsafe(16)
    first = {"type": "chat", "content": "Tell me about the sea. " * 8, "resumable": True, "params": GREEDY}
    home, frames = _ws_turn(ray_url, sid, first)
    assert frames[0] == {"type": "session", "session_id": sid, "resumed": False, "num_turns": 0, "num_tokens": 0}
    assert frames[-1]["type"] == "done", frames
    again = {"type": "chat", "content": "More.", "session_id": sid, "params": GREEDY}
    replica, frames = _ws_turn(ray_url, sid, again)
    assert replica == home and frames[0]["resumed"] is True, frames
    assert frames[-1]["type"] == "done" and frames[-1]["usage"]["cached_tokens"] >= frames[0]["num_tokens"] - 1

    # Its replica dies: the next turn of that session is session_lost, within a bound, from a live replica.
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#{home}", namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 120
    outcome: list[Any] | None = None
    failures: list[str] = []
    while outcome is None:
        assert time.monotonic() < deadline, f"no answer to the lost session's turn within 120 s: {failures[-3:]}"
        try:
            replica, outcome = _ws_turn(ray_url, sid, again, timeout=20)
        except (OSError, TimeoutError, WebSocketException) as e:  # until the router drops the dead replica
            failures.append(repr(e))
            time.sleep(0.5)
    assert replica != home
    error = outcome[-1]
    assert error["type"] == "error" and error["code"] == "session_lost", outcome
    assert not any(f["type"] == "delta" for f in outcome)

    # New sessions and stateless requests carry on.
    replica, frames = _ws_turn(ray_url, secrets.token_urlsafe(16), {**first, "content": "Hello again."})
    assert frames[-1]["type"] == "done", frames
    assert client.post("/v1/completions", json={"prompt": "Once upon", **GREEDY}).status_code == 200


def test_the_serve_run_builder_takes_serve_flags_as_key_value(tiny_model_dir: str) -> None:
    from streamkv.server.ray_app import CONSISTENT_HASH_ROUTER
    from streamkv.server.ray_entry import app_builder

    args = {"replicas": "3", "model": tiny_model_dir, "num_blocks": "256", "threads": "1", "no_prefix_caching": "true"}
    deployment = app_builder(args)._bound_deployment
    assert (deployment.name, deployment.num_replicas) == (DEPLOYMENT_NAME, 3)
    assert deployment.ray_actor_options == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert deployment._deployment_config.request_router_config.request_router_class == CONSISTENT_HASH_ROUTER
    engine_config, server_config, threads = deployment.init_args
    assert (engine_config.cache.num_blocks, engine_config.cache.enable_prefix_caching, threads) == (256, False, 1)
    with pytest.raises(SystemExit):
        app_builder({"replicas": "many"})
