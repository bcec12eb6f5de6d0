"""Bad requests: each gets its status and an OpenAI-shaped error, costs no block, and the next request works."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai_helpers import API_KEY, MAX_MODEL_LEN, post_json
from server_harness import RunningServer, connect_chat, recv_json, send_json, wait_for
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def assert_error(resp: httpx.Response, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def still_serves(srv: RunningServer) -> None:
    resp = post_json(srv, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2


@pytest.fixture(autouse=True)
def nothing_leaks(api_server: RunningServer) -> Iterator[None]:
    yield

    def idle() -> bool:
        snap = api_server.get("/api/stats").json()
        return snap["requests"]["running"] == snap["requests"]["waiting"] == 0 and snap["counts"]["used"] == 0

    wait_for(idle, timeout=30, what="no request running and no block in use")


@pytest.mark.parametrize(
    ("body", "status", "code", "param", "says"),
    [
        ({"model": "gpt-4", "prompt": "x"}, 404, "model_not_found", "model", "gpt-4"),
        ({"prompt": "x", "max_tokens": 0}, 400, "invalid_value", "max_tokens", "greater than or equal to 1"),
        ({"prompt": "x", "temperature": -1}, 400, "invalid_value", "temperature", "greater than or equal to 0"),
        ({"prompt": "x", "temperature": "hot"}, 400, "invalid_value", "temperature", "number"),
        ({"prompt": "x", "n": 17}, 400, "invalid_value", "n", "16"),
        ({"prompt": "x", "top_k": 0}, 400, "invalid_value", "top_k", "top_k"),
        ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "invalid_value", "min_tokens", "max_tokens"),
        ({"prompt": "x", "stream": "yes"}, 400, "invalid_value", "stream", "boolean"),
        ({"prompt": [5, 10**9]}, 400, "invalid_value", "prompt", "vocabulary"),
        ({"prompt": "x", "frequency_penalty": 0.5}, 400, "invalid_value", "frequency_penalty", "0"),
        ({"prompt": "x", "logprobs": 2, "echo": True}, 400, "invalid_value", "echo", "not supported"),
        (
            {"prompt": "x" * 3000},
            400,
            "context_length_exceeded",
            "prompt",
            f"maximum context length is {MAX_MODEL_LEN}",
        ),
        ({"max_tokens": 4}, 400, "invalid_value", "prompt", "required"),
    ],
)
def test_bad_completion_requests(
    api_server: RunningServer, body: dict[str, Any], status: int, code: str, param: str, says: str
) -> None:
    error = assert_error(post_json(api_server, "/v1/completions", body), status, code, param)
    assert says in error["message"]
    still_serves(api_server)


def test_nan_temperature_is_refused(api_server: RunningServer) -> None:
    for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}'):
        resp = httpx.post(api_server.http_url + "/v1/completions", content=raw, timeout=30)
        assert "finite" in assert_error(resp, 400, "invalid_value")["message"]
    still_serves(api_server)


def test_context_length_message_states_limit_and_lengths(api_server: RunningServer) -> None:
    ids = list(range(1000, 1200))
    error = assert_error(post_json(api_server, "/v1/completions", {"prompt": ids, "max_tokens": 100}), 400,
                         "context_length_exceeded")  # fmt: skip
    assert error["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested 300 tokens "
        "(200 in the prompt, 100 in the completion). Please reduce the length of the prompt or completion."
    )
    long_chat = {"messages": [{"role": "user", "content": "hello " * 400}]}
    error = assert_error(post_json(api_server, "/v1/chat/completions", long_chat), 400, "context_length_exceeded")
    assert (
        f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"] and "input tokens" in error["message"]
    )
    still_serves(api_server)


@pytest.mark.parametrize(
    ("raw", "says"), [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"), (b"", "not valid JSON")]
)
def test_malformed_json(api_server: RunningServer, raw: bytes, says: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        resp = httpx.post(api_server.http_url + path, content=raw, timeout=30)
        assert says in assert_error(resp, 400, "invalid_json")["message"]
    still_serves(api_server)


def test_bad_chat_messages(api_server: RunningServer) -> None:
    cases = [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content.0.type",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}, "max_completion_tokens"),
    ]
    for body, param in cases:
        assert_error(post_json(api_server, "/v1/chat/completions", body), 400, "invalid_value", param)
    still_serves(api_server)


def test_a_20_mb_body_gets_413(api_server: RunningServer) -> None:
    with openai.OpenAI(base_url=api_server.http_url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="tiny", prompt="x" * (20 << 20), max_tokens=1)
    assert info.value.status_code == 413
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "request_too_large" and str(1 << 20) in body["message"]
    # Without a Content-Length (chunked upload) the limit holds too.
    chunks = (b"x" * (1 << 16) for _ in range(40))
    resp = httpx.post(api_server.http_url + "/v1/completions", content=chunks, timeout=30)
    assert_error(resp, 413, "request_too_large")
    still_serves(api_server)


def test_openai_sdk_raises_typed_errors(api_server: RunningServer) -> None:
    with openai.OpenAI(base_url=api_server.http_url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt="hi", max_tokens=0)
        assert info.value.code == "invalid_value" and info.value.param == "max_tokens"
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=1).choices[0].finish_reason == "length"


# ------------------------------------------------------------------ API keys


def test_api_key_guards_every_route_but_health_and_metrics(keyed_server: RunningServer) -> None:
    url = keyed_server.http_url
    good = {"Authorization": f"Bearer {API_KEY}"}
    for bad in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/api/stats")):  # fmt: skip
            resp = httpx.request(method, url + path, headers=bad, json={"prompt": "x"}, timeout=30)
            error = assert_error(resp, 401, "invalid_api_key")
            assert ("missing" if not bad else "invalid") in error["message"]
            assert resp.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/healthz", timeout=30).status_code == 200
    assert httpx.get(url + "/metrics", timeout=30).status_code == 200
    assert httpx.get(url + "/v1/models", headers=good, timeout=30).json()["data"][0]["id"] == "tiny"
    assert httpx.get(url + "/api/stats", headers=good, timeout=30).status_code == 200
    with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2  # type: ignore[union-attr]


def test_api_key_guards_both_websockets(keyed_server: RunningServer) -> None:
    for path in ("/ws/chat", "/ws/stats", "/ws/chat?api_key=wrong"):
        with connect(keyed_server.ws_url(path), open_timeout=5, close_timeout=2) as ws:
            with pytest.raises(ConnectionClosed) as info:
                ws.recv(timeout=5)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1008
    with connect(keyed_server.ws_url(f"/ws/stats?api_key={API_KEY}"), open_timeout=5) as ws:
        assert "counts" in recv_json(ws)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with connect(keyed_server.ws_url("/ws/chat"), additional_headers=headers, open_timeout=5) as ws:
        send_json(ws, {"type": "chat", "content": "hi", "params": {"max_tokens": 2, "temperature": 0}})
        assert recv_json(ws)["type"] == "session"
    with connect_chat(keyed_server, f"/ws/chat?api_key={API_KEY}") as ws:
        send_json(ws, {"type": "reset"})
        assert recv_json(ws)["type"] == "reset"


def test_engine_down_is_503(api_server: RunningServer) -> None:
    engine = api_server.engine
    engine.error = RuntimeError("engine thread crashed (simulated)")
    try:
        routes = (
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        )
        for path, body in routes:
            assert_error(post_json(api_server, path, body), 503, "engine_stopped")
        assert api_server.get("/healthz").status_code == 503
    finally:
        engine.error = None
    still_serves(api_server)


def test_engine_refusals_map_to_statuses_whatever_the_code_type() -> None:
    """The engine's codes may be plain strings or str enums (the engine branch makes them enums)."""
    import enum

    from streamkv.errors import EngineError
    from streamkv.server.openai.errors import from_engine

    class Code(str, enum.Enum):
        ENGINE_STOPPED = "engine_stopped"
        EXCEEDS_POOL = "exceeds_pool"

    assert from_engine(EngineError(Code.ENGINE_STOPPED, "down")).status == 503
    assert from_engine(EngineError("engine_error", "crashed")).status == 503
    refusal = from_engine(EngineError(Code.EXCEEDS_POOL, "too big"))
    assert (refusal.status, refusal.code, refusal.body()["type"]) == (400, "exceeds_pool", "invalid_request_error")
