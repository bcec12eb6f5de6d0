"""EngineMetrics: event histograms, the scrape-time snapshot collector, and the exposition."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from streamkv.metrics import EngineMetrics

SNAPSHOT: dict[str, Any] = {
    "t": 0.0,
    "num_blocks": 100,
    "block_size": 16,
    "counts": {"free": 50, "cached": 10, "used": 30, "pinned": 8, "shared": 2},
    "kv_usage": 0.4,
    "requests": {"running": 3, "waiting": 2, "swapped": 1},
    "sessions": {"active": 4, "pinned_blocks": 8},
    "counters": {
        "prompt_tokens": 1000,
        "generation_tokens": 500,
        "prefix_cache_queries": 900,
        "prefix_cache_hits": 600,
        "preemptions": 5,
        "preemptions_recompute": 3,
        "preemptions_swap": 2,
        "evictions": 7,
        "cow_copies": 11,
        "swapped_out_blocks": 13,
        "computed_prompt_tokens": 400,
    },
    "finished": {"stop": 20, "length": 5, "cancelled": 2},
    "tokens_per_s": 42.5,
}


def scrape(m: EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_snapshot_becomes_gauges_and_counters() -> None:
    m = EngineMetrics()
    m.attach(lambda: SNAPSHOT)
    got = scrape(m)
    expected = {
        ("streamkv_num_requests_running", ()): 3,
        ("streamkv_num_requests_waiting", ()): 2,
        ("streamkv_num_requests_swapped", ()): 1,
        ("streamkv_kv_cache_usage_perc", ()): 0.4,
        ("streamkv_active_sessions", ()): 4,
        ("streamkv_pinned_blocks", ()): 8,
        ("streamkv_prompt_tokens_total", ()): 1000,
        ("streamkv_generation_tokens_total", ()): 500,
        ("streamkv_prefix_cache_queries_total", ()): 900,
        ("streamkv_prefix_cache_hits_total", ()): 600,
        ("streamkv_num_preemptions_total", (("mode", "recompute"),)): 3,
        ("streamkv_num_preemptions_total", (("mode", "swap"),)): 2,
        ("streamkv_kv_evictions_total", ()): 7,
        ("streamkv_cow_copies_total", ()): 11,
        ("streamkv_request_success_total", (("finished_reason", "stop"),)): 20,
        ("streamkv_request_success_total", (("finished_reason", "length"),)): 5,
        ("streamkv_request_success_total", (("finished_reason", "cancelled"),)): 2,
    }
    for state, n in SNAPSHOT["counts"].items():
        expected[("streamkv_kv_blocks", (("state", state),))] = n
    for key, value in expected.items():
        assert got[key] == value, key


def test_gauges_are_clamped_and_junk_reads_as_zero() -> None:
    m = EngineMetrics()
    m.attach(lambda: {"kv_usage": 1.7, "requests": {"running": -2, "waiting": "x"}, "counts": {"free": float("nan")}})
    got = scrape(m)
    assert got[("streamkv_kv_cache_usage_perc", ())] == 1.0
    assert got[("streamkv_num_requests_running", ())] == 0
    assert got[("streamkv_num_requests_waiting", ())] == 0
    assert got[("streamkv_kv_blocks", (("state", "free"),))] == 0
    assert got[("streamkv_prompt_tokens_total", ())] == 0
    m.attach(lambda: {"kv_usage": -0.5})
    assert scrape(m)[("streamkv_kv_cache_usage_perc", ())] == 0.0


def test_histograms_and_errors() -> None:
    m = EngineMetrics()
    m.observe_first_token(0.05)
    m.observe_first_token(2.0)
    m.observe_inter_token(0.003)
    m.observe_step(0.01, 48)
    m.observe_finished(1.5, 100, 20, "length")
    m.observe_finished(0.2, 10, 1, "cancelled")
    m.observe_loop_lag(0.0004)
    m.observe_loop_lag(-0.001)  # clock jitter: counted as 0
    m.observe_first_token(float("nan"))  # ignored
    for code in ("invalid_json", "invalid_json", "session_busy"):
        m.count_error(code)
    got = scrape(m)
    assert got[("streamkv_time_to_first_token_seconds_count", ())] == 2
    assert got[("streamkv_time_to_first_token_seconds_bucket", (("le", "0.06"),))] == 1
    assert got[("streamkv_time_to_first_token_seconds_sum", ())] == pytest.approx(2.05)
    assert got[("streamkv_inter_token_latency_seconds_count", ())] == 1
    assert got[("streamkv_step_duration_seconds_count", ())] == 1
    assert got[("streamkv_step_num_scheduled_tokens_sum", ())] == 48
    assert got[("streamkv_e2e_request_latency_seconds_count", (("finished_reason", "length"),))] == 1
    assert got[("streamkv_e2e_request_latency_seconds_count", (("finished_reason", "cancelled"),))] == 1
    assert got[("streamkv_e2e_request_latency_seconds_count", (("finished_reason", "stop"),))] == 0
    assert got[("streamkv_request_prompt_tokens_sum", ())] == 110
    assert got[("streamkv_request_generation_tokens_sum", ())] == 21
    assert got[("streamkv_event_loop_lag_seconds_count", ())] == 2
    assert got[("streamkv_event_loop_lag_seconds_sum", ())] == pytest.approx(0.0004)
    assert got[("streamkv_errors_total", (("code", "invalid_json"),))] == 2
    assert got[("streamkv_errors_total", (("code", "session_busy"),))] == 1
    assert got[("streamkv_errors_total", (("code", "unknown_session"),))] == 0  # pre-created


def test_greedy_head_counts_rows_candidates_and_fallbacks() -> None:
    m = EngineMetrics()
    m.observe_greedy_head(32, 190, False)
    m.observe_greedy_head(8, 9, False)
    m.observe_greedy_head(16, 0, True)  # handed back: its rows went through the logits, counted as a fallback only
    got = scrape(m)
    assert got[("streamkv_greedy_head_rows_total", ())] == 40
    assert got[("streamkv_greedy_head_candidates_total", ())] == 199
    assert got[("streamkv_greedy_head_fallbacks_total", ())] == 1


def test_latency_buckets_span_1ms_to_60s() -> None:
    m = EngineMetrics()
    got = scrape(m)
    les = [
        float(dict(k[1])["le"])
        for k in got
        if k[0] == "streamkv_e2e_request_latency_seconds_bucket" and dict(k[1])["finished_reason"] == "stop"
    ]
    finite = sorted(x for x in les if x != float("inf"))
    assert finite[0] == 0.001 and finite[-1] == 60.0


def test_registries_are_private_and_independent() -> None:
    a, b = EngineMetrics(), EngineMetrics()
    a.count_error("invalid_json")
    assert scrape(b)[("streamkv_errors_total", (("code", "invalid_json"),))] == 0
    assert REGISTRY.get_sample_value("streamkv_errors_total", {"code": "invalid_json"}) is None


def test_a_failing_snapshot_does_not_break_the_scrape(caplog: pytest.LogCaptureFixture) -> None:
    m = EngineMetrics()

    def boom() -> dict[str, Any]:
        raise RuntimeError("engine gone")

    m.attach(boom)
    m.observe_first_token(0.1)
    got = scrape(m)
    assert got[("streamkv_time_to_first_token_seconds_count", ())] == 1
    assert ("streamkv_num_requests_running", ()) not in got
    assert "stats snapshot failed" in caplog.text
    m.attach(None)
    assert ("streamkv_num_requests_running", ()) not in scrape(m)


def test_observations_from_many_threads() -> None:
    m = EngineMetrics()

    def work() -> None:
        for _ in range(1000):
            m.observe_inter_token(0.002)
            m.count_error("invalid_params")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    got = scrape(m)
    assert got[("streamkv_inter_token_latency_seconds_count", ())] == 8000
    assert got[("streamkv_errors_total", (("code", "invalid_params"),))] == 8000


def test_no_created_series() -> None:
    # prometheus-client adds a *_created timestamp per counter and histogram unless told not to
    m = EngineMetrics()
    m.attach(lambda: SNAPSHOT)
    m.observe_first_token(0.1)
    m.count_error("invalid_json")
    body = m.render()[0].decode()
    assert "streamkv_errors_total" in body and "streamkv_time_to_first_token_seconds_count" in body
    assert "_created" not in body


def test_pinned_blocks_counts_a_block_two_sessions_pin_once(tiny) -> None:
    from tests.engine_helpers import greedy, make_llm, prompts_of

    llm = make_llm(tiny, num_blocks=64)
    prompt = prompts_of([70], seed=21)[0]  # 4 full blocks + a partial one, shared by both sessions
    llm.generate([prompt], greedy(4), session_ids=["a"])
    llm.generate([prompt], greedy(4), session_ids=["b"])
    pool = llm.core.kv.pool
    distinct = sum(1 for b in pool.blocks if b.pin_cnt)
    shared = sum(1 for b in pool.blocks if b.pin_cnt == 2)
    assert shared >= 4  # the prompt's full blocks are pinned by both sessions
    snap = llm.core.snapshot()
    assert snap["sessions"]["pinned_blocks"] == distinct
    m = EngineMetrics()
    m.attach(lambda: snap)
    assert scrape(m)[("streamkv_pinned_blocks", ())] == distinct
    llm.core.check_invariants()
