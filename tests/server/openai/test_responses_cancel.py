"""``POST /v1/responses/{id}/cancel`` (``client.responses.cancel``), real SDK, real server.

A response in flight (on a WebSocket lane, or streaming over HTTP) is
cancelled from another request: it ends ``cancelled``, it is stored, and a
continuation of it starts from exactly the tokens it sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from responses_helpers import SERVER_EVENT, Reply, client, create_response, held_blocks, read_reply, responses_server
from server_harness import RunningServer, wait_for

from streamkv.model.loader import LoadedModel

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0, "max_output_tokens": 12}
LONG: dict[str, Any] = {**GREEDY, "max_output_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(tiny_model_dir: str, tiny: LoadedModel) -> Iterator[RunningServer]:
    with responses_server(tiny_model_dir, tiny) as s:
        yield s


def create(conn: Any, text: str, previous: str | None = None, **fields: Any) -> Any:
    return create_response(conn, text, {**GREEDY, **fields}, previous)


def test_a_cancelled_lane_response_is_stored_and_continues_from_exactly_its_tokens(srv: RunningServer) -> None:
    with client(srv) as c, c.responses.connect() as conn:
        first = create(conn, "Start of the story.")
        conn.send({"type": "response.create", "input": "Go on at length.", "previous_response_id": first.id, **LONG})
        reply = Reply()
        while sum(e.type == "response.output_text.delta" for e in reply.events) < 3:
            raw = conn.recv_bytes()
            SERVER_EVENT.validate_json(raw)
            reply.events.append(conn.parse_event(raw))
        rid = reply.events[0].response.id
        cancelled = c.responses.cancel(rid)  # from another request; returns once the response is stored
        rest = read_reply(conn)
        reply.events += rest.events
        assert reply.final.type == "response.incomplete" and reply.response.status == "cancelled"
        assert cancelled.status == "cancelled" and cancelled.id == rid
        k = cancelled.usage.output_tokens
        assert 3 <= k < 400
        assert cancelled.output_text == reply.text == reply.response.output_text
        assert c.responses.retrieve(rid).status == "cancelled"
        assert c.responses.cancel(rid).model_dump() == cancelled.model_dump()  # again: unchanged
        after = create(conn, "Something else.", cancelled.id)
        # its tokens are in the chain: at most the block the engine ran ahead into is recomputed
        assert after.usage.input_tokens_details.cached_tokens >= cancelled.usage.total_tokens - 16

        # the same chain with the answer cut at those k tokens by max_output_tokens instead
        fresh = create(conn, "Start of the story.")
        cut = create(conn, "Go on at length.", fresh.id, **{**LONG, "max_output_tokens": k})
        assert cut.status == "incomplete" and cut.output_text == cancelled.output_text
        fresh_after = create(conn, "Something else.", cut.id)
    # no token after the cancel point entered the chain: the same prompt, the same greedy answer
    assert cancelled.usage.total_tokens == cut.usage.total_tokens
    assert after.usage.input_tokens == fresh_after.usage.input_tokens
    assert after.output_text == fresh_after.output_text
    with client(srv) as c:
        for r in (first, cancelled, after, fresh, cut, fresh_after):
            c.responses.delete(r.id)
    wait_for(lambda: held_blocks(srv) == 0, timeout=10, what="every block free after the chains are deleted")


def test_a_streaming_http_response_is_cancelled_from_another_request(srv: RunningServer) -> None:
    with client(srv) as c, client(srv) as other:
        events = []
        long = {k: v for k, v in LONG.items() if k != "ignore_eos"}
        with c.responses.create(
            input="Talk for a long time.", stream=True, **long, extra_body={"ignore_eos": True}
        ) as stream:
            for event in stream:
                SERVER_EVENT.validate_python(event.model_dump(mode="json"))
                events.append(event)
                if sum(e.type == "response.output_text.delta" for e in events) == 3:
                    cancelled = other.responses.cancel(events[0].response.id)
        final = events[-1]
        assert final.type == "response.incomplete" and final.response.status == "cancelled"
        assert cancelled.model_dump() == final.response.model_dump()
        assert cancelled.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert cancelled.usage.output_tokens < 400
        c.responses.delete(cancelled.id)
    wait_for(lambda: held_blocks(srv) == 0, timeout=10, what="every block free")


def test_cancel_refuses_finished_and_unknown_responses(srv: RunningServer) -> None:
    with client(srv) as c:
        done = c.responses.create(input="Short.", **GREEDY)
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.cancel(done.id)
        assert e.value.code == "invalid_value" and e.value.param == "response_id"
        assert c.responses.retrieve(done.id).status == done.status  # unchanged
        with pytest.raises(openai.NotFoundError) as nf:
            c.responses.cancel("resp_unknown")
        assert nf.value.code == "response_not_found"
        private = c.responses.create(input="Forget me.", store=False, **GREEDY)
        with pytest.raises(openai.NotFoundError):
            c.responses.cancel(private.id)
        c.responses.delete(done.id)
    wait_for(lambda: held_blocks(srv) == 0, timeout=10, what="every block free")
