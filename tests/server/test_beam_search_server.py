"""``beam_width`` over ``/v1/completions`` and ``/ws/chat``, against a real server (tiny model).

The answers equal the offline ``LLM.beam_search`` on the same model; refusals
are a 400 or an ``invalid_params`` frame and hold no block.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest
from server_harness import RunningServer, build_engine, chat_turn, connect_chat, make_server, wait_for

from streamkv.llm import LLM
from streamkv.model.chat import ChatFormatter
from streamkv.model.loader import LoadedModel

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # the tokenizer load took 300 s when loaded

PROMPT = [504, 3575, 282, 4649, 314, 1345, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39]


@pytest.fixture(scope="module")
def offline(tiny: LoadedModel) -> LLM:
    return LLM(loaded=tiny, device="cpu", num_blocks=128, attention_backend="torch")


@pytest.fixture
def beam_server(tiny_model_dir: str, tiny: LoadedModel) -> Iterator[RunningServer]:
    engine, metrics = build_engine(
        tiny_model_dir, tiny, max_model_len=1024, num_blocks=128, attention_backend="torch"
    )  # as `offline`
    with make_server(engine, metrics=metrics) as srv:
        yield srv


def pool_idle(srv: RunningServer) -> bool:
    counts = srv.engine.snapshot(include_blocks=False)["counts"]
    return counts["used"] == counts["shared"] == 0


def post(srv: RunningServer, body: dict[str, object]) -> httpx.Response:
    return httpx.post(srv.http_url + "/v1/completions", json=body, timeout=120)


def test_completions_with_beam_width(beam_server: RunningServer, offline: LLM) -> None:
    (want,) = offline.beam_search([PROMPT], 3, 8, 0.8, num_hypotheses=2, ignore_eos=True)
    body = {"prompt": PROMPT, "max_tokens": 8, "beam_width": 3, "n": 2, "length_penalty": 0.8, "ignore_eos": True}
    reply = post(beam_server, body)
    assert reply.status_code == 200, reply.text
    got = reply.json()
    assert [c["text"] for c in got["choices"]] == [o.text for o in want.outputs]
    assert [c["finish_reason"] for c in got["choices"]] == ["length", "length"]
    assert got["usage"]["completion_tokens"] == 16  # the two hypotheses returned, not every beam tried

    url = beam_server.http_url + "/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = {0: "", 1: ""}
    for e in events[:-1]:
        for c in orjson.loads(e)["choices"]:
            text[c["index"]] += c["text"]
    assert [text[0], text[1]] == [o.text for o in want.outputs]
    wait_for(lambda: pool_idle(beam_server), timeout=30, what="every block back in the pool")


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"logprobs": 1}, "logprobs"), ({"n": 3}, "n"), ({"stop": ["x"]}, "stop"), ({"beam_width": 0}, "beam_width")],
)
def test_completions_refuses_what_beam_search_cannot_do(beam_server: RunningServer, extra, param) -> None:
    reply = post(beam_server, {"prompt": PROMPT, "max_tokens": 4, "beam_width": 2, **extra})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert pool_idle(beam_server)


def test_ws_chat_with_beam_width(beam_server: RunningServer, offline: LLM, tiny: LoadedModel) -> None:
    params = {"max_tokens": 6, "temperature": 0, "beam_width": 2, "ignore_eos": True}
    prompt = ChatFormatter(tiny.tokenizer).first_turn("Hello!")
    (want,) = offline.beam_search([prompt], 2, 6, num_hypotheses=1, ignore_eos=True)
    with connect_chat(beam_server) as ws:
        t1 = chat_turn(ws, "Hello!", params=params, timeout=120)
        assert t1.done is not None, t1.frames
        assert t1.token_ids[0] == want.outputs[0].token_ids and t1.text[0] == want.outputs[0].text
        assert t1.done["finish_reasons"] == ["length"]
        assert [f["type"] for f in t1.frames].count("delta") == 1  # the best hypothesis, once, at the end
        t2 = chat_turn(ws, "And then?", params=params, timeout=120)
        assert t2.done is not None, t2.frames
        # the session kept the beam closest to the answer: turn 2 reuses the history
        assert t2.done["usage"]["cached_tokens"] >= t1.done["usage"]["prompt_tokens"]
        bad = chat_turn(ws, "x", params={**params, "n": 3}, timeout=30)
        assert bad.error is not None and bad.error["code"] == "invalid_params"
        assert "params.n" in bad.error["message"]
    wait_for(lambda: pool_idle(beam_server), timeout=30, what="every block back in the pool")
