"""/ws/chat against a FakeEngine behind a real uvicorn server and a real websockets client."""

from __future__ import annotations

import pytest
from bad_frames import BAD_FRAMES
from fake_engine import EOS, FakeChat, FakeEngine, token_at, token_text
from server_harness import (
    RunningServer,
    chat_frame,
    chat_turn,
    connect_chat,
    recv_json,
    recv_until,
    send_json,
    wait_for,
)

from streamkv.server.sessions import SessionState

pytestmark = pytest.mark.timeout(30)
chat = FakeChat()


def expected_tokens(prompt_len: int, n: int, index: int = 0) -> list[int]:
    return [token_at(prompt_len, step, index) for step in range(n)]


def test_two_turn_conversation_reuses_history(server: RunningServer, engine: FakeEngine) -> None:
    with connect_chat(server) as ws:
        t1 = chat_turn(ws, "hello", system="be brief", params={"max_tokens": 5})
        assert t1.session_id is not None and t1.done is not None
        p1 = chat.first_turn("hello", "be brief")
        assert engine.requests[0].prompt_ids == p1
        assert engine.requests[0].session_id == t1.session_id
        gen1 = expected_tokens(len(p1), 5)
        assert t1.token_ids[0] == gen1
        assert t1.text[0] == "".join(token_text(t) for t in gen1)
        assert t1.done["finish_reason"] == "length" and t1.done["finish_reasons"] == ["length"]
        assert t1.done["usage"] == {"prompt_tokens": len(p1), "cached_tokens": 0, "completion_tokens": 5}
        assert t1.done["timings"]["ttft_ms"] > 0 and t1.done["timings"]["total_ms"] >= t1.done["timings"]["ttft_ms"]

        # Turn 2: the answer ended without EOS, so the template closes it first.
        engine.stop_after = 3
        t2 = chat_turn(ws, "more", params={"max_tokens": 8})
        assert t2.session_id is None, "the session frame comes once per session"
        p2 = p1 + gen1 + chat.next_turn("more", False)
        assert engine.requests[1].prompt_ids == p2
        assert engine.requests[1].session_id == t1.session_id
        assert t2.done is not None and t2.done["finish_reason"] == "stop"
        assert t2.done["usage"]["cached_tokens"] == len(p1) + len(gen1)  # the pin was reused
        assert t2.token_ids[0][-1] == EOS

        # Turn 3 follows an answer that ended on EOS: nothing to close.
        t3 = chat_turn(ws, "again", session_id=t1.session_id, params={"max_tokens": 2})
        assert t3.done is not None
        p3 = p2 + t2.token_ids[0] + chat.next_turn("again", True)
        assert engine.requests[2].prompt_ids == p3
    wait_for(lambda: engine.released == [t1.session_id], what="session released on close")
    assert engine.blocks_in_use == 0


def test_bad_frames_get_their_code_and_the_socket_keeps_working(server: RunningServer, engine: FakeEngine) -> None:
    with connect_chat(server) as ws:
        good = chat_turn(ws, "hi", params={"max_tokens": 1})
        assert good.done is not None
        history = engine.requests[-1].prompt_ids + good.token_ids[0]
        for name, raw, code, word in BAD_FRAMES:
            ws.send(raw)
            frame = recv_json(ws)
            assert frame["type"] == "error", name
            assert frame["code"] == code, (name, frame)
            assert word in frame["message"], (name, frame)
            turn = chat_turn(ws, "ok", params={"max_tokens": 1})
            assert turn.done is not None and turn.done["finish_reason"] == "length", name
            # Errors never touch the history: each good turn extends the previous one.
            assert engine.requests[-1].prompt_ids == history + chat.next_turn("ok", False), name
            history = engine.requests[-1].prompt_ids + turn.token_ids[0]


def test_engine_rejection_keeps_history(server: RunningServer, engine: FakeEngine) -> None:
    with connect_chat(server) as ws:
        t1 = chat_turn(ws, "hi", params={"max_tokens": 2})
        too_long = chat_turn(ws, "x" * 3000, params={"max_tokens": 2})
        assert too_long.error is not None and too_long.error["code"] == "prompt_too_long"
        too_many = chat_turn(ws, "hi", params={"max_tokens": 5000})
        assert too_many.error is not None and too_many.error["code"] == "prompt_too_long"
        t2 = chat_turn(ws, "next", params={"max_tokens": 2})
        assert t2.done is not None
        p1 = chat.first_turn("hi", None)
        assert engine.requests[-1].prompt_ids == p1 + t1.token_ids[0] + chat.next_turn("next", False)


def test_second_chat_while_busy_is_refused(server: RunningServer, engine: FakeEngine) -> None:
    with connect_chat(server) as ws:
        send_json(ws, chat_frame("long", params={"max_tokens": 60}))
        recv_until(ws, {"delta"})
        send_json(ws, chat_frame("impatient"))
        frames = recv_until(ws, {"error", "done"})
        assert frames[-1]["type"] == "error" and frames[-1]["code"] == "session_busy"
        rest = recv_until(ws, {"done"})
        assert rest[-1]["finish_reason"] == "length"
        assert sum(len(f["token_ids"]) for f in frames + rest if f["type"] == "delta") == 59
        assert len(engine.requests) == 1


def test_cancel_mid_answer(server: RunningServer, engine: FakeEngine) -> None:
    with connect_chat(server) as ws:
        send_json(ws, chat_frame("tell me everything", params={"max_tokens": 1000}))
        frames = recv_until(ws, {"delta"})
        sid = frames[0]["session_id"]
        send_json(ws, {"type": "cancel"})
        frames += recv_until(ws, {"done"})
        done = frames[-1]
        assert done["finish_reason"] == "cancelled" and done["finish_reasons"] == ["cancelled"]
        received = [t for f in frames if f["type"] == "delta" for t in f["token_ids"]]
        assert 0 < len(received) < 1000 and done["usage"]["completion_tokens"] == len(received)
        wait_for(lambda: engine.blocks_in_use == 0, what="blocks freed")
        assert len(engine.aborted) == 1
        send_json(ws, {"type": "cancel"})  # nothing in flight: a no-op, no frame
        # The cancelled answer is part of the history.
        t2 = chat_turn(ws, "go on", params={"max_tokens": 2})
        assert t2.done is not None and t2.session_id is None
        p1 = chat.first_turn("tell me everything", None)
        assert engine.requests[-1].prompt_ids == p1 + received + chat.next_turn("go on", False)
        assert engine.requests[-1].session_id == sid


def test_disconnect_mid_answer_aborts_and_frees(server: RunningServer, engine: FakeEngine) -> None:
    with connect_chat(server) as ws:
        send_json(ws, chat_frame("long", params={"max_tokens": 1000}))
        frames = recv_until(ws, {"delta"})
        sid = frames[0]["session_id"]
    wait_for(lambda: len(engine.aborted) == 1, what="engine saw the abort")
    wait_for(lambda: engine.released == [sid], what="session released")
    assert engine.blocks_in_use == 0 and engine.pinned_blocks == 0
    assert len(server.app.state.sessions) == 0


def test_reset(server: RunningServer, engine: FakeEngine) -> None:
    with connect_chat(server) as ws:
        t1 = chat_turn(ws, "hi", params={"max_tokens": 2})
        send_json(ws, chat_frame("long", params={"max_tokens": 1000}))
        recv_until(ws, {"delta"})
        send_json(ws, {"type": "reset"})
        frames = recv_until(ws, {"reset"})
        assert [f["finish_reason"] for f in frames if f["type"] == "done"] == ["cancelled"]
        assert engine.released == [t1.session_id] and engine.blocks_in_use == 0
        t2 = chat_turn(ws, "fresh", params={"max_tokens": 2})
        assert t2.session_id is not None and t2.session_id != t1.session_id
        assert engine.requests[-1].prompt_ids == chat.first_turn("fresh", None)
        old = chat_turn(ws, "x", session_id=t1.session_id)
        assert old.error is not None and old.error["code"] == "invalid_params"  # this socket holds t2's session
    with connect_chat(server) as ws2:
        old = chat_turn(ws2, "x", session_id=t1.session_id)
        assert old.error is not None and old.error["code"] == "unknown_session"


def test_sessions_are_independent(server: RunningServer, engine: FakeEngine) -> None:
    with connect_chat(server) as a, connect_chat(server) as b:
        send_json(a, chat_frame("story", params={"max_tokens": 40}))
        recv_until(a, {"delta"})
        for _, raw, code, _word in BAD_FRAMES[:12]:
            b.send(raw)
            assert recv_json(b)["code"] == code
        assert chat_turn(b, "x" * 3000).error is not None
        send_json(b, {"type": "cancel"})
        send_json(b, {"type": "reset"})
        assert recv_json(b)["type"] == "reset"
        tb = chat_turn(b, "quick", params={"max_tokens": 3})
        assert tb.done is not None and tb.done["finish_reason"] == "length"
        rest = recv_until(a, {"done"})
        assert rest[-1]["finish_reason"] == "length"
        assert rest[-1]["usage"]["completion_tokens"] == 40
        assert not any(f["type"] == "error" for f in rest)


def test_n_samples(server: RunningServer, engine: FakeEngine) -> None:
    with connect_chat(server) as ws:
        turn = chat_turn(ws, "pick", params={"max_tokens": 4, "n": 3})
        assert turn.done is not None
        assert turn.done["finish_reasons"] == ["length"] * 3
        assert turn.done["usage"]["completion_tokens"] == 12
        p = chat.first_turn("pick", None)
        for i in range(3):
            assert turn.token_ids[i] == expected_tokens(len(p), 4, i)
        # Sample 0 continues the conversation.
        chat_turn(ws, "next", params={"max_tokens": 1})
        assert engine.requests[-1].prompt_ids == p + turn.token_ids[0] + chat.next_turn("next", False)


def test_binary_frames_are_accepted(server: RunningServer) -> None:
    with connect_chat(server) as ws:
        ws.send(b'{"type": "chat", "content": "hi", "params": {"max_tokens": 2}}')
        assert recv_until(ws, {"done"})[-1]["finish_reason"] == "length"


def test_resume_after_reconnect(server: RunningServer, engine: FakeEngine) -> None:
    with connect_chat(server) as ws:
        t1 = chat_turn(ws, "remember", resumable=True, params={"max_tokens": 3})
        sid = t1.session_id
        assert sid is not None
    sessions = server.app.state.sessions
    wait_for(lambda: sessions.num_detached == 1, what="session detached")
    assert engine.released == [] and engine.pins[sid]
    with connect_chat(server) as ws:
        bogus = chat_turn(ws, "x", session_id="not-a-session")
        assert bogus.error is not None and bogus.error["code"] == "unknown_session"
        t2 = chat_turn(ws, "what?", session_id=sid, params={"max_tokens": 2})
        num_tokens = len(chat.first_turn("remember", None)) + len(t1.token_ids[0])
        assert t2.frames[0] == {
            "type": "session", "session_id": sid, "resumed": True, "num_turns": 1, "num_tokens": num_tokens
        }
        p1 = chat.first_turn("remember", None)
        assert engine.requests[-1].prompt_ids == p1 + t1.token_ids[0] + chat.next_turn("what?", False)
        with connect_chat(server) as other:  # held by the first socket
            busy = chat_turn(other, "mine", session_id=sid)
            assert busy.error is not None and busy.error["code"] == "session_busy"
        # A resumable session survives a disconnect mid-answer, without the answer the client never saw.
        send_json(ws, chat_frame("long", params={"max_tokens": 1000}))
        recv_until(ws, {"delta"})
    wait_for(lambda: sessions.num_detached == 1 and engine.blocks_in_use == 0, what="detached again")
    assert sessions.get(sid).state is SessionState.DETACHED
    history = engine.requests[-2].prompt_ids + engine.requests[-2].output_ids[0]  # after "what?"
    assert engine.requests[-1].output_ids[0], "the cut answer had begun"
    with connect_chat(server) as ws:
        resumed = chat_turn(ws, "resumed", session_id=sid, params={"max_tokens": 1})
        assert (resumed.frames[0]["num_turns"], resumed.frames[0]["num_tokens"]) == (2, len(history))
        assert engine.requests[-1].prompt_ids == history + chat.next_turn("resumed", False)
        send_json(ws, {"type": "reset"})
        recv_until(ws, {"reset"})
    assert engine.released == [sid] and len(sessions) == 0


def test_resumable_session_expires_after_ttl(metrics: object) -> None:
    from server_harness import make_server

    from streamkv.config import ServerConfig

    engine = FakeEngine()
    with make_server(engine, server_config=ServerConfig(stats_interval=0.05, session_ttl=0.2)) as srv:
        with connect_chat(srv) as ws:
            sid = chat_turn(ws, "hi", resumable=True, params={"max_tokens": 1}).session_id
        wait_for(lambda: engine.released == [sid], timeout=5, what="the sweeper released the session")
        assert srv.app.state.sessions.num_detached == 0
        with connect_chat(srv) as ws:
            turn = chat_turn(ws, "back", session_id=sid)
            assert turn.error is not None and turn.error["code"] == "unknown_session"
            fresh = chat_turn(ws, "new", params={"max_tokens": 1})  # the socket still works
            assert fresh.session_id is not None and fresh.session_id != sid


def test_cancel_right_after_chat(server: RunningServer, engine: FakeEngine) -> None:
    """chat and cancel in one burst: the turn may be cancelled before it ever ran."""
    with connect_chat(server) as ws:
        for _ in range(20):
            send_json(ws, chat_frame("hi", params={"max_tokens": 50}))
            send_json(ws, {"type": "cancel"})
            frames = recv_until(ws, {"done", "error"})
            assert frames[-1]["type"] == "done", frames
            assert frames[-1]["finish_reason"] in ("cancelled", "length"), frames
        turn = chat_turn(ws, "still fine", params={"max_tokens": 2})
        assert turn.done is not None and turn.done["finish_reason"] == "length"
    wait_for(lambda: engine.blocks_in_use == 0 and len(server.app.state.sessions) == 0, what="all released")


def test_max_sessions_evicts_detached_then_refuses(metrics: object) -> None:
    from prometheus_client.parser import text_string_to_metric_families
    from server_harness import make_server

    from streamkv.config import ServerConfig
    from streamkv.metrics import EngineMetrics

    def session_gauge(srv: RunningServer) -> dict[str, float]:
        text = srv.get("/metrics").text
        return {
            s.labels["state"]: s.value
            for f in text_string_to_metric_families(text)
            if f.name == "streamkv_chat_sessions"
            for s in f.samples
        }

    engine, m = FakeEngine(), EngineMetrics()
    with make_server(engine, metrics=m, server_config=ServerConfig(stats_interval=0.05, max_sessions=2)) as srv:
        sessions = srv.app.state.sessions
        with connect_chat(srv) as ws:
            old = chat_turn(ws, "first", resumable=True, params={"max_tokens": 1}).session_id
        wait_for(lambda: sessions.num_detached == 1, what="session detached")
        assert session_gauge(srv) == {"attached": 0.0, "resumable": 1.0}
        with connect_chat(srv) as a, connect_chat(srv) as b:
            assert chat_turn(a, "second", params={"max_tokens": 1}).session_id is not None
            assert session_gauge(srv) == {"attached": 1.0, "resumable": 1.0}
            assert chat_turn(b, "third", params={"max_tokens": 1}).session_id is not None  # evicts `old`
            assert engine.released == [old] and old not in engine.pins
            assert session_gauge(srv) == {"attached": 2.0, "resumable": 0.0}
            with connect_chat(srv) as c:
                refused = chat_turn(c, "fourth", params={"max_tokens": 1})
                assert refused.error is not None and refused.error["code"] == "too_many_sessions"
                assert refused.session_id is None and len(sessions) == 2
                gone = chat_turn(c, "back", session_id=old)
                assert gone.error is not None and gone.error["code"] == "unknown_session"
        wait_for(lambda: len(sessions) == 0, what="sessions released")
        assert session_gauge(srv) == {"attached": 0.0, "resumable": 0.0}
