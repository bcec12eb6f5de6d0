"""Multi-turn sessions over the WebSocket against the real engine (tiny model)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import (
    RunningServer,
    Turn,
    chat_frame,
    chat_turn,
    connect_chat,
    make_server,
    recv_until,
    send_json,
    wait_for,
)

from streamkv.cache.block import KVBlock
from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.metrics import EngineMetrics
from streamkv.model.loader import LoadedModel

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
GREEDY = {"max_tokens": 9, "temperature": 0}


def serve(tiny: LoadedModel, tiny_model_dir: str, **cache_and_sched: int) -> RunningServer:
    from streamkv.engine import AsyncEngine

    sched = {k: v for k, v in cache_and_sched.items() if k in SchedulerConfig.__dataclass_fields__}
    cache = {k: v for k, v in cache_and_sched.items() if k in CacheConfig.__dataclass_fields__}
    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"),
        cache=CacheConfig(**cache),
        scheduler=SchedulerConfig(**sched),
    )
    metrics = EngineMetrics()
    return make_server(AsyncEngine(config, metrics, loaded=tiny), metrics=metrics)


@pytest.fixture
def server(tiny: LoadedModel, tiny_model_dir: str) -> Iterator[RunningServer]:
    with serve(tiny, tiny_model_dir, num_blocks=256, max_model_len=1024) as srv:
        yield srv


def test_six_turns_compute_only_their_new_tokens(server: RunningServer) -> None:
    core = server.engine.core
    with connect_chat(server) as ws:
        prev = None
        sid = None
        pinned_before: list[KVBlock] = []  # the pin after the previous turn (read from turn 1 on)
        for turn in range(6):
            before = core.scheduler.counters.computed_prompt_tokens
            t = chat_turn(ws, f"Turn {turn}: tell me something new.", params=GREEDY, timeout=60)
            assert t.done is not None, t.frames
            usage = t.done["usage"]
            sid = sid or t.session_id
            computed = core.scheduler.counters.computed_prompt_tokens - before
            assert computed == usage["prompt_tokens"] - usage["cached_tokens"]
            if prev is not None:
                # the whole history is reused from the pin; what is computed is this turn's
                # template text plus the previous answer's last token (sampled, never fed)
                assert usage["cached_tokens"] == prev["prompt_tokens"] + prev["completion_tokens"] - 1
                new_ids = usage["prompt_tokens"] - prev["prompt_tokens"] - prev["completion_tokens"]
                assert computed == new_ids + 1
                # the same block table continues, the partial last block included (no copy)
                table = [b.block_id for b in core.kv.sessions[sid].blocks]
                assert table[: len(pinned_before)] == [b.block_id for b in pinned_before]
            pinned_before = list(core.kv.sessions[sid].blocks)
            prev = usage
    core.check_invariants()


def test_a_conversation_crossing_max_model_len_gets_the_error_on_that_turn(
    tiny: LoadedModel, tiny_model_dir: str
) -> None:
    with serve(tiny, tiny_model_dir, num_blocks=64, max_model_len=160) as srv, connect_chat(srv) as ws:
        codes = []
        for turn in range(30):  # noqa: B007 - read after the loop: the turn that crossed the limit
            t = chat_turn(ws, "Please continue the story with more words.", params=GREEDY, timeout=60)
            if t.error is not None:
                codes.append(t.error["code"])
                break
        assert codes == ["prompt_too_long"], "the conversation should have crossed 160 tokens"
        assert turn >= 2  # earlier turns fit
        # the same socket's history is unchanged and a new conversation still works
        send_json(ws, {"type": "reset"})
        recv_until(ws, {"reset"}, timeout=10)
        t = chat_turn(ws, "Hello again.", params=GREEDY, timeout=60)
        assert t.done is not None and t.done["finish_reason"] == "length"


def test_ten_conversations_in_a_pool_for_three(tiny: LoadedModel, tiny_model_dir: str) -> None:
    # each conversation reaches ~130 tokens = 9 blocks; the pool holds 30 blocks
    with serve(tiny, tiny_model_dir, num_blocks=30, max_model_len=512, max_pinned_fraction=1.0) as srv:
        sockets = [connect_chat(srv) for _ in range(10)]
        try:
            for turn in range(3):
                for ws in sockets:  # interleaved: all ten in flight at once
                    send_json(ws, chat_frame(f"Conversation turn {turn}, say more.", params=GREEDY))
                for ws in sockets:
                    frames = recv_until(ws, {"done", "error"}, timeout=120)
                    assert frames[-1]["type"] == "done", frames[-1]
                    assert frames[-1]["usage"]["completion_tokens"] == GREEDY["max_tokens"]
        finally:
            for ws in sockets:
                ws.close()
        core = srv.engine.core
        snap = srv.engine.snapshot()
        assert snap["counters"]["evictions"] > 0 or len(core.kv.sessions) < 10  # pins gave way
        # every socket closed (not resumable): every pin released, nothing leaked
        for _ in range(100):
            if not core.kv.sessions and not core.requests:
                break
            import time

            time.sleep(0.05)
        core.check_invariants()
        counts = core.kv.pool.state_counts()
        assert counts["used"] == counts["pinned"] == counts["shared"] == 0, counts


def test_metrics_count_a_real_workload(server: RunningServer) -> None:
    with connect_chat(server) as ws:
        done = chat_turn(ws, "Hello!", params=GREEDY, timeout=60)
        assert done.done is not None
        send_json(ws, {"type": "chat", "content": "x", "params": {"max_tokens": 0}})
        assert recv_until(ws, {"error"})[-1]["code"] == "invalid_params"
        send_json(ws, chat_frame("A long one.", params={"max_tokens": 400, "temperature": 0}))
        recv_until(ws, {"delta"}, timeout=60)
        send_json(ws, {"type": "cancel"})
        assert recv_until(ws, {"done"}, timeout=60)[-1]["finish_reason"] == "cancelled"
    body = server.get("/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
    }
    assert samples[("streamkv_errors_total", (("code", "invalid_params"),))] == 1
    assert samples[("streamkv_request_success_total", (("finished_reason", "length"),))] == 1
    assert samples[("streamkv_request_success_total", (("finished_reason", "cancelled"),))] == 1
    assert samples[("streamkv_generation_tokens_total", ())] >= GREEDY["max_tokens"] + 1
    assert samples[("streamkv_time_to_first_token_seconds_count", ())] == 2
    assert 0.0 <= samples[("streamkv_kv_cache_usage_perc", ())] <= 1.0


def test_stats_never_name_another_session(server: RunningServer) -> None:
    """Session ids are capabilities: a viewer sees its own blocks, others' only as anonymous states."""
    import orjson

    with connect_chat(server) as a, connect_chat(server) as b:
        sid_a = chat_turn(a, "Hello there, session A.", params=GREEDY, timeout=60).session_id
        sid_b = chat_turn(b, "Hello there, session B.", params=GREEDY, timeout=60).session_id
        anonymous = server.get("/api/stats")
        assert anonymous.json()["session_blocks"] == {}
        assert sid_a not in anonymous.text and sid_b not in anonymous.text
        own = server.get(f"/api/stats?session_id={sid_a}")
        blocks = own.json()["session_blocks"]
        assert list(blocks) == [sid_a] and blocks[sid_a]
        assert sid_b not in own.text
        assert own.json()["counts"]["pinned"] >= 2  # B's pin still shows, by state only
        with connect_chat(server, f"/ws/stats?session_id={sid_b}") as stats:
            text = stats.recv(timeout=10)
        assert sid_a not in text and list(orjson.loads(text)["session_blocks"]) == [sid_b]


def _spanning_stop(pieces: list[str]) -> str:
    """A stop string that starts inside one token's text and ends inside the next one's, found once."""
    text = "".join(pieces)
    start = 0
    for k in range(2, len(pieces) - 1):
        start = sum(len(p) for p in pieces[:k])
        a, b = pieces[k], pieces[k + 1]
        if len(a) >= 2 and len(b) >= 2 and "\ufffd" not in a + b:
            stop = a[1:] + b[:1]
            if text.find(stop) == start + 1:
                return stop
    pytest.skip("the tiny model's answer has no two adjacent multi-character tokens")


def test_delta_token_ids_decode_to_the_delta_text(server: RunningServer, tiny: LoadedModel) -> None:
    """Ids held back for a possible stop string travel with their text (#15 item 15)."""
    tok = tiny.tokenizer
    params = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with connect_chat(server) as ws:
        free_run = chat_turn(ws, "Tell me a story about a cat.", params=params, timeout=60)
    ids = free_run.token_ids[0]
    pieces = [tok.decode([t], skip_special_tokens=True) for t in ids]
    stop = _spanning_stop(pieces)
    with connect_chat(server) as ws:
        stopped = chat_turn(ws, "Tell me a story about a cat.", params={**params, "stop": [stop]}, timeout=60)
    assert stopped.done is not None and stopped.done["finish_reason"] == "stop"
    deltas = [f for f in stopped.frames if f["type"] == "delta"]
    for f in deltas[:-1]:
        assert tok.decode(f["token_ids"], skip_special_tokens=True) == f["text"], f
    last = tok.decode(deltas[-1]["token_ids"], skip_special_tokens=True)
    assert last.startswith(deltas[-1]["text"]) and stop in last  # the stop string's tokens end the turn
    assert stopped.text[0] == free_run.text[0][: free_run.text[0].find(stop)]
    assert stopped.token_ids[0] == ids[: len(stopped.token_ids[0])]


LONG = {"max_tokens": 600, "temperature": 0, "ignore_eos": True}


def test_a_turn_cut_short_by_a_disconnect_stays_out_of_the_history(server: RunningServer) -> None:
    """The client never saw it; the next turn equals a fresh run of the same history (#15 item 14)."""
    core = server.engine.core
    with connect_chat(server) as ws:
        t1 = chat_turn(ws, "First question.", resumable=True, params=GREEDY, timeout=60)
        sid = t1.session_id
        assert sid is not None and t1.done is not None
        send_json(ws, chat_frame("Now a very long answer, please.", params=LONG))
        recv_until(ws, {"delta"}, 60)  # the answer has begun; the socket closes mid-answer
    history = t1.done["usage"]["prompt_tokens"] + t1.done["usage"]["completion_tokens"]
    wait_for(lambda: server.app.state.sessions.num_detached == 1, timeout=30, what="session detached")
    wait_for(lambda: sid in core.kv.sessions, timeout=30, what="the cut turn pinned")
    assert len(core.kv.sessions[sid].token_ids) > history  # the pin holds the dropped turn as its tail
    with connect_chat(server) as ws:
        resumed = chat_turn(ws, "Second question.", session_id=sid, params=GREEDY, timeout=60)
    assert resumed.frames[0]["num_turns"] == 1 and resumed.frames[0]["num_tokens"] == history
    with connect_chat(server) as ws:
        chat_turn(ws, "First question.", params=GREEDY, timeout=60)
        fresh = chat_turn(ws, "Second question.", params=GREEDY, timeout=60)
    assert resumed.done is not None and fresh.done is not None
    assert resumed.token_ids[0] == fresh.token_ids[0] and resumed.text == fresh.text
    assert resumed.done["usage"]["prompt_tokens"] == fresh.done["usage"]["prompt_tokens"]
    core.check_invariants()


def test_a_cancelled_turn_keeps_its_text_and_reports_cached_tokens(server: RunningServer) -> None:
    with connect_chat(server) as ws:
        t1 = chat_turn(ws, "First question.", resumable=True, params=GREEDY, timeout=60)
        sid = t1.session_id
        assert sid is not None and t1.done is not None
        send_json(ws, chat_frame("Now a very long answer, please.", params=LONG))
        frames = recv_until(ws, {"delta"}, 60)
        send_json(ws, {"type": "cancel"})
        t2 = Turn.from_frames(frames + recv_until(ws, {"done"}, 60))
    assert t2.done is not None and t2.done["finish_reason"] == "cancelled"
    usage, u1 = t2.done["usage"], t1.done["usage"]
    assert usage["cached_tokens"] == u1["prompt_tokens"] + u1["completion_tokens"] - 1  # turn 1 from the pin
    assert usage["completion_tokens"] == len(t2.token_ids[0]) > 0
    wait_for(lambda: server.app.state.sessions.num_detached == 1, timeout=30, what="session detached")
    with connect_chat(server) as ws:
        t3 = chat_turn(ws, "Go on.", session_id=sid, params=GREEDY, timeout=60)
    assert t3.frames[0]["num_turns"] == 2
    assert t3.frames[0]["num_tokens"] == usage["prompt_tokens"] + len(t2.token_ids[0])
    assert t3.done is not None and t3.done["usage"]["prompt_tokens"] > t3.frames[0]["num_tokens"]
