"""The Responses API's WebSocket mode, driven by ``client.responses.connect()`` (real SDK, real server).

Chains of the tiny random model, greedy: a chained turn computes only its new
tokens, its text equals a ``/ws/chat`` session's, forks share blocks, lanes
run concurrently, and abandoned or expired responses leave nothing behind.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from responses_helpers import (
    CLOSING,
    OPENING,
    block_counts,
    client,
    held_blocks,
    metric,
    read_reply,
    responses_server,
)
from server_harness import RunningServer, chat_turn, connect_chat, wait_for

from streamkv.model.loader import LoadedModel

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

TURNS = ["Hello, who are you?", "Tell me more.", "And then?", "Thanks, bye."]
GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def srv(tiny_model_dir: str, tiny: LoadedModel) -> Iterator[RunningServer]:
    with responses_server(tiny_model_dir, tiny) as s:
        yield s


def chain(conn: Any, turns: list[str], previous: str | None = None, **create: Any) -> list[Any]:
    """Run ``turns`` as one chain over ``conn``; returns each turn's Reply."""
    replies = []
    for text in turns:
        conn.response.create(
            input=text, **{**GREEDY, **create}, **({"previous_response_id": previous} if previous else {})
        )
        reply = read_reply(conn)
        assert reply.final.type in ("response.completed", "response.incomplete"), reply.final
        previous = reply.response.id
        replies.append(reply)
    return replies


def delete_all(srv: RunningServer, ids: list[str]) -> None:
    with client(srv) as c:
        for rid in ids:
            c.responses.delete(rid)


def test_four_turn_chain_computes_only_new_tokens_and_matches_ws_chat(srv: RunningServer) -> None:
    with client(srv) as c, c.responses.connect() as conn:
        replies = chain(conn, TURNS)
    for k, reply in enumerate(replies):
        n = len(reply.types) - len(OPENING) - len(CLOSING) - 1
        assert reply.types == OPENING + ["response.output_text.delta"] * n + CLOSING + [reply.final.type]
        assert [e.sequence_number for e in reply.events] == list(range(len(reply.events)))
        assert len({e.item_id for e in reply.events if hasattr(e, "item_id")}) == 1
        usage = reply.response.usage
        if k:
            prev = replies[k - 1].response.usage
            history = prev.input_tokens + prev.output_tokens
            # every token of the earlier turns, less the one sampled token whose KV is computed now
            assert usage.input_tokens_details.cached_tokens == history - 1
            assert reply.response.previous_response_id == replies[k - 1].response.id
        assert reply.response.output_text == reply.text
    assert metric(srv, "streamkv_responses_stored_total") >= 4

    with connect_chat(srv) as ws:
        texts = [
            chat_turn(ws, t, params={"temperature": 0, "max_tokens": 12}, timeout=60).text.get(0, "") for t in TURNS
        ]
    assert texts == [r.text for r in replies]
    delete_all(srv, [r.response.id for r in replies])
    wait_for(lambda: held_blocks(srv) == 0, timeout=10, what="every block free")


def test_a_fork_shares_the_prefix_blocks_and_equals_a_fresh_chain(srv: RunningServer) -> None:
    forks_before = metric(srv, "streamkv_chains_forked_total")
    with client(srv) as c, c.responses.connect() as conn:
        replies = chain(conn, TURNS)
        (fork,) = chain(conn, ["A different third turn."], previous=replies[1].response.id)
        assert block_counts(srv)["shared"] > 0  # the fork's full prefix blocks are the chain's (ref count 2)
        fork_id, head_id = fork.response.id, replies[-1].response.id
        stats = {
            rid: httpx.get(f"{srv.http_url}/api/stats?response_id={rid}", timeout=10).json()
            for rid in (fork_id, head_id)
        }
        fork_blocks, head_blocks = (set(stats[rid]["session_blocks"][rid]) for rid in (fork_id, head_id))
        assert fork_blocks & head_blocks  # the block map names both chains' blocks; they share the prefix
        # the fork's prefix came from the prefix cache: whole blocks, at least every full block of turn 2
        cached = fork.response.usage.input_tokens_details.cached_tokens
        history = replies[1].response.usage.total_tokens
        assert cached % 16 == 0 and cached >= history - history % 16
    assert metric(srv, "streamkv_chains_forked_total") == forks_before + 1
    with client(srv) as c, c.responses.connect() as conn:
        fresh = chain(conn, TURNS[:2] + ["A different third turn."])
    assert fresh[-1].text == fork.text
    delete_all(srv, [r.response.id for r in replies + [fork] + fresh])
    wait_for(lambda: held_blocks(srv) == 0, timeout=10, what="every block free")


def test_lanes_run_concurrently_and_one_lane_runs_in_order(srv: RunningServer) -> None:
    long = {**GREEDY, "max_output_tokens": 48}
    with client(srv) as c, c.responses.connect() as conn:
        conn.response.create(input="lane a", stream_id="a", **long)
        conn.response.create(input="lane b", stream_id="b", **long)
        conn.response.create(input="lane a again", stream_id="a", **long)
        events = []
        while sum(e.type in ("response.completed", "response.incomplete") for e in events) < 3:
            events.append(conn.recv())
    order = [(e.stream_id, e.type) for e in events]
    first_a_done = order.index(("a", "response.incomplete"))
    b_created = order.index(("b", "response.created"))
    assert b_created < first_a_done  # lane b started before lane a's first response ended
    a_created = [i for i, (lane, kind) in enumerate(order) if lane == "a" and kind == "response.created"]
    assert len(a_created) == 2 and a_created[1] > first_a_done  # the second create on lane a waited its turn
    deltas = {ln: [i for i, (lane, kind) in enumerate(order) if lane == ln and kind.endswith(".delta")] for ln in "ab"}
    first_a = [i for i in deltas["a"] if i < first_a_done]
    assert min(deltas["b"]) < max(first_a) and min(first_a) < max(deltas["b"])  # interleaved: concurrent
    ids = [e.response.id for e in events if e.type == "response.incomplete"]
    delete_all(srv, ids)
    wait_for(lambda: held_blocks(srv) == 0, timeout=10, what="every block free")


def test_errors_keep_the_socket_open(srv: RunningServer) -> None:
    not_found = metric(srv, "streamkv_previous_response_not_found_total")
    with client(srv) as c, c.responses.connect() as conn:
        conn.response.create(input="x", previous_response_id="resp_unknown", **GREEDY)
        err = read_reply(conn).final
        assert err.type == "error" and err.error.code == "previous_response_not_found"
        assert err.error.param == "previous_response_id" and err.status == 400
        conn.response.create(input="x", model="tiny", max_output_tokens=0)
        err = read_reply(conn).final
        assert err.type == "error" and err.error.code == "invalid_value" and err.error.param == "max_output_tokens"
        conn.send({"type": "response.create", "input": "x", "model": "tiny", "temperature": "hot"})  # type: ignore[typeddict-item]
        assert read_reply(conn).final.error.param == "temperature"
        (ok,) = chain(conn, ["still here"])
    assert metric(srv, "streamkv_previous_response_not_found_total") == not_found + 1
    delete_all(srv, [ok.response.id])


def test_store_false_lives_on_its_connection_only(srv: RunningServer) -> None:
    with client(srv) as c:
        with c.responses.connect() as conn:
            (first,) = chain(conn, ["private"], store=False)
            (second,) = chain(conn, ["still private"], previous=first.response.id, store=False)
            assert second.response.usage.input_tokens_details.cached_tokens == first.response.usage.total_tokens - 1
            with c.responses.connect() as other:
                other.response.create(input="x", previous_response_id=second.response.id, **GREEDY)
                assert read_reply(other).final.error.code == "previous_response_not_found"
        # the socket closed: its chains are gone with it
        wait_for(lambda: held_blocks(srv) == 0, timeout=10, what="the store: false chain released")


def test_previous_response_not_found_after_the_ttl(tiny_model_dir: str, tiny: LoadedModel) -> None:
    with responses_server(tiny_model_dir, tiny, session_ttl=0.5) as short, client(short) as c:
        with c.responses.connect() as conn:
            (first,) = chain(conn, ["short-lived"])
            time.sleep(1.2)
            conn.response.create(input="too late", previous_response_id=first.response.id, **GREEDY)
            assert read_reply(conn).final.error.code == "previous_response_not_found"
        wait_for(lambda: held_blocks(short) == 0, timeout=10, what="the expired chain released")


def test_a_disconnect_mid_response_leaves_the_chain_as_it_was(srv: RunningServer) -> None:
    with client(srv) as c:
        with c.responses.connect() as conn:
            (first,) = chain(conn, ["Start of the story."])
            conn.response.create(input="Go on at length.", previous_response_id=first.response.id,
                                 **{**GREEDY, "max_output_tokens": 400})  # fmt: skip
            created = conn.recv()
            assert created.type == "response.created"
            while conn.recv().type != "response.output_text.delta":
                pass
        # the socket is closed mid-answer; a new one continues from the last completed response
        with c.responses.connect() as conn:
            (resumed,) = chain(conn, ["Something else."], previous=first.response.id)
        with pytest.raises(Exception) as gone:
            c.responses.retrieve(created.response.id)
        assert getattr(gone.value, "status_code", None) == 404
        with c.responses.connect() as conn:
            fresh = chain(conn, ["Start of the story.", "Something else."])
        # no text of the abandoned response entered the chain: the same prompt as a fresh chain's
        assert resumed.response.usage.input_tokens == fresh[1].response.usage.input_tokens
        assert resumed.text == fresh[1].text
        assert resumed.response.usage.input_tokens_details.cached_tokens >= first.response.usage.total_tokens - 16
    delete_all(srv, [first.response.id, resumed.response.id] + [r.response.id for r in fresh])
    wait_for(lambda: held_blocks(srv) == 0, timeout=10, what="every block free after the chains are deleted")
