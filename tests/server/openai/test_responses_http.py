"""``POST /v1/responses`` (streamed and not), ``GET`` and ``DELETE /v1/responses/{id}``, with the real SDK."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from responses_helpers import CLOSING, OPENING, SERVER_EVENT, client, held_blocks, responses_server
from server_harness import RunningServer, wait_for

from streamkv.model.loader import LoadedModel

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 10}


@pytest.fixture(scope="module")
def srv(tiny_model_dir: str, tiny: LoadedModel) -> Iterator[RunningServer]:
    with responses_server(tiny_model_dir, tiny) as s:
        yield s


def test_a_chain_over_http_reuses_its_pin_and_can_be_fetched_and_deleted(srv: RunningServer) -> None:
    with client(srv) as c:
        first = c.responses.create(input="Hello!", instructions="Be brief.", **GREEDY)
        assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
        assert first.usage.input_tokens_details.cached_tokens == 0
        second = c.responses.create(input="More.", previous_response_id=first.id, **GREEDY)
        # an incomplete response continues from exactly its tokens; all of them but the last sampled one are cached
        assert second.usage.input_tokens_details.cached_tokens == first.usage.total_tokens - 1
        assert second.instructions is None and second.previous_response_id == first.id
        fetched = c.responses.retrieve(second.id)
        assert fetched.output_text == second.output_text and fetched.usage == second.usage
        c.responses.delete(second.id)
        c.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.retrieve(second.id)
        assert e.value.code == "response_not_found"
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(input="x", previous_response_id=second.id, **GREEDY)
        assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"
    wait_for(lambda: held_blocks(srv) == 0, timeout=10, what="every block free")


def test_streamed_events_come_in_the_sdk_order_and_shapes(srv: RunningServer) -> None:
    with client(srv) as c:
        events = list(c.responses.create(input="Stream, please.", stream=True, **GREEDY))
        for e in events:
            SERVER_EVENT.validate_python(e.model_dump(mode="json"))
        types = [e.type for e in events]
        n = len(types) - len(OPENING) - len(CLOSING) - 1
        assert types == OPENING + ["response.output_text.delta"] * n + CLOSING + ["response.incomplete"]
        final = events[-1].response
        assert final.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
        unstreamed = c.responses.create(input="Stream, please.", **GREEDY)
        assert unstreamed.output_text == final.output_text
        c.responses.delete(final.id)
        c.responses.delete(unstreamed.id)


def test_store_false_over_http_keeps_nothing_and_bad_fields_are_400(srv: RunningServer) -> None:
    with client(srv) as c:
        r = c.responses.create(input="Forget me.", store=False, **GREEDY)
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(input="x", previous_response_id=r.id, **GREEDY)
        assert e.value.code == "previous_response_not_found"
        for bad, param in [({"max_output_tokens": 0}, "max_output_tokens"), ({"top_p": 0}, "top_p")]:
            with pytest.raises(openai.BadRequestError) as e:
                c.responses.create(input="x", **{**GREEDY, **bad})  # type: ignore[arg-type]
            assert e.value.code == "invalid_value" and e.value.param == param
        with pytest.raises(openai.NotFoundError):
            c.responses.create(input="x", model="another-model")
    wait_for(lambda: held_blocks(srv) == 0, timeout=10, what="every block free")
