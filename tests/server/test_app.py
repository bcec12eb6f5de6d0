"""HTTP routes, the lifespan, and /metrics counting what the test did."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from prometheus_client.parser import text_string_to_metric_families
from server_harness import RunningServer, chat_frame, chat_turn, connect_chat, make_server, recv_until, send_json
from server_harness import wait_for as wait_until

from streamkv.metrics import EngineMetrics
from streamkv.server.app import DEFAULT_WEB_DIR

pytestmark = pytest.mark.timeout(30)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a Prometheus exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_healthz(server: RunningServer) -> None:
    r = server.get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "model": "fake-model", "max_model_len": 2048}


def test_api_stats(server: RunningServer, engine: FakeEngine) -> None:
    with connect_chat(server) as ws:
        sid = chat_turn(ws, "hi", params={"max_tokens": 3}).session_id
        r = server.get("/api/stats")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        snap = r.json()
        assert snap["num_blocks"] == 512 and len(base64.b64decode(snap["states"])) == 512
        assert snap["session_blocks"] == {}  # session ids are capabilities: never listed
        assert server.get("/api/stats?session_id=other").json()["session_blocks"] == {}
        assert list(server.get(f"/api/stats?session_id={sid}").json()["session_blocks"]) == [sid]


def test_index_and_static(engine: FakeEngine, tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("<h1>streamkv</h1>")
    (tmp_path / "app.js").write_text("console.log(1)")
    with make_server(engine, web_dir=tmp_path) as srv:
        r = srv.get("/")
        assert (
            r.status_code == 200 and "<h1>streamkv</h1>" in r.text and r.headers["content-type"].startswith("text/html")
        )
        assert srv.get("/static/app.js").text == "console.log(1)"
        assert srv.get("/static/missing.js").status_code == 404


def test_missing_web_dir_is_a_clear_404(engine: FakeEngine, tmp_path: Path) -> None:
    with make_server(engine, web_dir=tmp_path / "nope") as srv:
        r = srv.get("/")
        assert r.status_code == 404 and "web UI not found" in r.text
        assert srv.get("/healthz").status_code == 200


def test_repo_web_ui_is_served(server: RunningServer) -> None:
    assert Path(__file__).resolve().parents[2] / "web" == DEFAULT_WEB_DIR
    if not (DEFAULT_WEB_DIR / "index.html").is_file():
        pytest.skip("no web/index.html in this checkout")
    r = server.get("/")
    assert r.status_code == 200 and r.text == (DEFAULT_WEB_DIR / "index.html").read_text()
    for path in sorted(DEFAULT_WEB_DIR.iterdir()):
        if path.is_file():
            assert server.get(f"/static/{path.name}").status_code == 200, path.name


def test_lifespan_starts_and_stops_the_engine() -> None:
    engine = FakeEngine()
    with make_server(engine) as srv:
        assert engine.started and engine.start_calls == 1
        with connect_chat(srv) as ws:
            sid = chat_turn(ws, "keep", resumable=True, params={"max_tokens": 1}).session_id
        wait_until(lambda: srv.app.state.sessions.num_detached == 1, what="detached")
    assert not engine.started and engine.shutdown_calls == 1
    assert engine.released == [sid], "shutdown releases detached sessions"


def test_metrics_count_what_happened(metrics: EngineMetrics, engine: FakeEngine, server: RunningServer) -> None:
    errors = {"invalid_json": 0, "unknown_type": 0, "invalid_params": 0, "prompt_too_long": 0, "session_busy": 0}
    finished = {"stop": 0, "length": 0, "cancelled": 0}
    with connect_chat(server) as ws:
        for _ in range(2):
            ws.send("{nope")
            errors["invalid_json"] += 1
        ws.send('{"type": "fly"}')
        errors["unknown_type"] += 1
        for bad in ({"max_tokens": 0}, {"top_p": 2}, {"n": True}):
            send_json(ws, chat_frame("hi", params=bad))
            errors["invalid_params"] += 1
        recv_until(ws, {"error"})
        for _ in range(5):
            recv_until(ws, {"error"})
        chat_turn(ws, "a", params={"max_tokens": 3})
        chat_turn(ws, "b", params={"max_tokens": 2})
        finished["length"] += 2
        assert chat_turn(ws, "c", params={"max_tokens": 9999}).error is not None
        errors["prompt_too_long"] += 1
        engine.stop_after = 2
        chat_turn(ws, "d", params={"max_tokens": 5})
        finished["stop"] += 1
        engine.stop_after = None
        send_json(ws, chat_frame("long", params={"max_tokens": 500}))
        recv_until(ws, {"delta"})
        send_json(ws, chat_frame("busy"))
        errors["session_busy"] += 1
        send_json(ws, {"type": "cancel"})
        recv_until(ws, {"done"})
        finished["cancelled"] += 1

    def lag_samples() -> float:
        return samples(server.get("/metrics").text)[("streamkv_event_loop_lag_seconds_count", ())]

    wait_until(lambda: lag_samples() >= 1, what="a loop-lag sample")
    r = server.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    got = samples(r.text)
    for code, n in errors.items():
        assert got[("streamkv_errors_total", (("code", code),))] == n, code
    assert got[("streamkv_errors_total", (("code", "frame_too_large"),))] == 0
    for reason, n in finished.items():
        assert got[("streamkv_request_success_total", (("finished_reason", reason),))] == n, reason
    assert got[("streamkv_time_to_first_token_seconds_count", ())] == 4
    assert got[("streamkv_e2e_request_latency_seconds_count", (("finished_reason", "length"),))] == 2
    assert got[("streamkv_request_generation_tokens_sum", ())] == 3 + 2 + 2
    assert got[("streamkv_num_requests_running", ())] == 0
    assert got[("streamkv_generation_tokens_total", ())] == engine.counters["generation_tokens"]
    assert got[("streamkv_kv_blocks", (("state", "free"),))] == 512 - engine.pinned_blocks
    assert got[("streamkv_event_loop_lag_seconds_count", ())] >= 1
    assert 0.0 <= got[("streamkv_kv_cache_usage_perc", ())] <= 1.0


def test_shutdown_with_a_turn_in_flight() -> None:
    engine = FakeEngine()
    with make_server(engine) as srv:
        ws = connect_chat(srv)
        try:
            send_json(ws, chat_frame("long", params={"max_tokens": 1000}))
            recv_until(ws, {"delta"})
        except BaseException:
            ws.close()
            raise
    # The server closed the socket (1012), the turn was aborted and everything released.
    ws.close()
    assert not engine.started
    assert len(engine.aborted) == 1 and engine.blocks_in_use == 0
    assert engine.released == [engine.requests[0].session_id]
