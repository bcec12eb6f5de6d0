"""The block map of a response chain: ``/ws/stats?response_id=`` and ``/api/stats?response_id=``.

A Responses client knows only its response ids, never its chain's session id;
the stats feed takes a response id and lists its chain's blocks under it.
Real SDK (``client.responses.connect()``) making the chains, a WebSocket
client reading the feed.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from responses_helpers import client, create_response, held_blocks, responses_server
from server_harness import RunningServer, connect_chat, wait_for
from websockets.exceptions import ConnectionClosed

from streamkv.cache.block import cdiv
from streamkv.model.loader import LoadedModel

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# ignore_eos: every turn adds its full 24 tokens, so the chain grows by at least one block a turn
GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0, "max_output_tokens": 24, "ignore_eos": True}
TURNS = ["Hello, who are you?", "Tell me more.", "And then?"]


@pytest.fixture(scope="module")
def srv(tiny_model_dir: str, tiny: LoadedModel) -> Iterator[RunningServer]:
    with responses_server(tiny_model_dir, tiny) as s:
        yield s


def feed(srv: RunningServer, query: str) -> dict[str, Any]:
    """One snapshot of ``/ws/stats?<query>``."""
    with connect_chat(srv, f"/ws/stats?{query}") as ws:
        snap: dict[str, Any] = orjson.loads(ws.recv(timeout=10))
    return snap


def blocks_of(srv: RunningServer, response_id: str) -> list[int]:
    """The blocks ``/ws/stats?response_id=`` lists for ``response_id`` ([] when it lists none)."""
    snap = feed(srv, f"response_id={response_id}")
    assert set(snap["session_blocks"]) <= {response_id}  # only ever the caller's own id
    blocks: list[int] = snap["session_blocks"].get(response_id, [])
    return blocks


def state_names(snap: dict[str, Any]) -> list[str]:
    return [snap["state_names"][b] for b in base64.b64decode(snap["states"])]


def create(conn: Any, text: str, previous: str | None = None, **fields: Any) -> Any:
    return create_response(conn, text, {**GREEDY, **fields}, previous)


def test_the_feed_shows_a_chain_by_response_id_turn_by_turn_and_nothing_after_delete(srv: RunningServer) -> None:
    with client(srv) as c, c.responses.connect() as conn:
        responses, seen = [], []
        previous = None
        for text in TURNS:
            response = create(conn, text, previous)
            previous = response.id
            blocks = blocks_of(srv, response.id)
            total = response.usage.total_tokens  # the chain's tokens; the last sampled one has no KV yet
            assert cdiv(total - 1, 16) <= len(blocks) <= cdiv(total, 16)
            if seen:
                assert len(blocks) > len(seen[-1])  # the chain grows turn by turn
                full = responses[-1].usage.total_tokens // 16
                assert blocks[:full] == seen[-1][:full]  # ... on the same blocks: the pin was adopted
            responses.append(response)
            seen.append(blocks)
        head = seen[-1]
        snap = feed(srv, f"response_id={responses[-1].id}")
        assert {state_names(snap)[b] for b in head} == {"pinned"}  # one chain, ref count 1, pinned
        # an older response of the chain shows the blocks of the token prefix it names
        first = responses[0]
        assert blocks_of(srv, first.id) == head[: cdiv(first.usage.total_tokens, 16)]
        # /api/stats answers the same
        api = httpx.get(f"{srv.http_url}/api/stats", params={"response_id": responses[-1].id}, timeout=10).json()
        assert api["session_blocks"] == {responses[-1].id: head}

        # a fork from turn 2 shares the prefix blocks copy-on-write: ref count 2, "shared" in the map
        fork = create(conn, "A different third turn.", responses[1].id)
        snap = feed(srv, f"response_id={fork.id}")
        fork_blocks = snap["session_blocks"][fork.id]
        names = state_names(snap)
        shared = set(fork_blocks) & set(blocks_of(srv, responses[-1].id))
        assert len(shared) >= responses[1].usage.total_tokens // 16 > 0
        assert {names[b] for b in shared} == {"shared"}
        assert {names[b] for b in set(fork_blocks) - shared} <= {"pinned"}

    ids = [r.id for r in responses] + [fork.id]
    with client(srv) as c:
        for rid in ids:
            c.responses.delete(rid)
    assert all(blocks_of(srv, rid) == [] for rid in ids)
    wait_for(lambda: held_blocks(srv) == 0, timeout=10, what="every block free after DELETE")
    snap = feed(srv, f"response_id={ids[-1]}")
    assert snap["counts"]["free"] + snap["counts"]["cached"] == snap["num_blocks"]


def test_unknown_and_other_connections_store_false_ids_look_like_unknown_sessions(srv: RunningServer) -> None:
    unknown_session = feed(srv, "session_id=no-such-session")
    unknown_response = feed(srv, "response_id=resp_no_such_response")
    assert unknown_session["session_blocks"] == unknown_response["session_blocks"] == {}
    assert set(unknown_session) == set(unknown_response)
    with client(srv) as c, c.responses.connect() as conn:
        private = create(conn, "private", store=False)
        assert held_blocks(srv) > 0  # its chain is pinned on this connection ...
        assert blocks_of(srv, private.id) == []  # ... and not visible from another one
        api = httpx.get(f"{srv.http_url}/api/stats", params={"response_id": private.id}, timeout=10).json()
        assert api["session_blocks"] == {}
    wait_for(lambda: held_blocks(srv) == 0, timeout=10, what="the store: false chain released with its socket")


def test_naming_a_session_and_a_response_is_refused(srv: RunningServer) -> None:
    both = {"session_id": "some-session", "response_id": "resp_x"}
    r = httpx.get(f"{srv.http_url}/api/stats", params=both, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_params"
    with connect_chat(srv, "/ws/stats?session_id=some-session&response_id=resp_x") as ws:
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


def test_the_api_key_guards_the_feed(tiny_model_dir: str, tiny: LoadedModel) -> None:
    with responses_server(tiny_model_dir, tiny, api_key="sk-feed") as keyed:
        with connect_chat(keyed, "/ws/stats?response_id=resp_x") as ws:
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        assert httpx.get(f"{keyed.http_url}/api/stats?response_id=resp_x", timeout=10).status_code == 401
        assert feed(keyed, "response_id=resp_x&api_key=sk-feed")["session_blocks"] == {}
