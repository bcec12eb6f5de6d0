"""``POST /v1/responses`` (streamed and not), ``GET`` and ``DELETE /v1/responses/{id}``, with the real SDK."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from responses_helpers import CLOSING, OPENING, SERVER_EVENT, client, held_blocks, responses_server
from server_harness import RunningServer, wait_for

from streamkv.model.chat import ChatFormatter
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


def test_a_chained_turn_takes_several_messages_through_the_chat_template(srv: RunningServer, tiny: LoadedModel) -> None:
    chat = ChatFormatter(tiny.tokenizer)
    new = [
        {"role": "user", "content": "Here is a fact: the sky is blue."},
        {"role": "assistant", "content": "Noted."},
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "What colour is the sky?"},
    ]
    items = [
        {"type": "message", "role": m["role"], "content": [{"type": "input_text", "text": m["content"]}]}
        if m["role"] == "user"
        else {"role": m["role"], "content": m["content"]}
        for m in new
    ]
    with client(srv) as c:
        first = c.responses.create(input="Hello!", **GREEDY)
        assert first.status == "incomplete"  # cut by max_output_tokens: its last id is not EOS
        second = c.responses.create(input=items, previous_response_id=first.id, **GREEDY)  # type: ignore[arg-type]
        # the new part is the template's rendering of the four messages after the history, nothing re-tokenized
        rendered = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]} for m in new]
        extension = chat.next_messages(rendered, last_finished_on_eos=False)
        assert second.usage.input_tokens == first.usage.total_tokens + len(extension)
        assert second.usage.input_tokens_details.cached_tokens == first.usage.total_tokens - 1  # the pin adopted
        # ... and it is how a stateless request with the whole transcript tokenizes the new part
        stateless = chat.conversation([{"role": "user", "content": "Hello!"},
                                       {"role": "assistant", "content": first.output_text}, *rendered])  # fmt: skip
        assert stateless[-len(extension) :] == extension
        # one message through next_messages is the same as the one-user-turn path
        assert chat.next_messages([{"role": "user", "content": "x"}], False) == chat.next_turn("x", False)
        c.responses.delete(second.id)
        c.responses.delete(first.id)
    wait_for(lambda: held_blocks(srv) == 0, timeout=10, what="every block free")


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "function_call_output", "call_id": "c1", "output": "42"}, "input.0.type"),
        (
            {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]},
            "input.0.content.0.type",
        ),
        ({"role": "tool", "content": "42"}, "input.0.role"),
    ],
)
def test_unknown_input_items_are_a_clear_400_and_cost_nothing(
    srv: RunningServer, item: dict[str, Any], param: str
) -> None:
    with client(srv) as c:
        first = c.responses.create(input="Hello!", **GREEDY)
        held = held_blocks(srv)
        for previous in (first.id, None):
            with pytest.raises(openai.BadRequestError) as e:
                c.responses.create(input=[item], **GREEDY, **({"previous_response_id": previous} if previous else {}))  # type: ignore[arg-type]
            assert e.value.code == "invalid_value" and e.value.param == param
            assert e.value.type == "invalid_request_error"
        assert held_blocks(srv) == held  # nothing held, nothing released
        second = c.responses.create(input="Still here.", previous_response_id=first.id, **GREEDY)
        assert second.usage.input_tokens_details.cached_tokens == first.usage.total_tokens - 1  # the chain is intact
        c.responses.delete(second.id)
        c.responses.delete(first.id)
    wait_for(lambda: held_blocks(srv) == 0, timeout=10, what="every block free")
