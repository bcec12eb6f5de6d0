"""The OpenAI API driven by the real ``openai`` SDK against uvicorn + AsyncEngine (tiny random Llama).

Truth for greedy text is ``LLM.generate`` and ``/ws/chat`` on the same
prompt ids; every test leaves the pool idle (checked at the end of each).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from openai_helpers import MAX_MODEL_LEN, NUM_BLOCKS, post_json
from server_harness import RunningServer, chat_turn, connect_chat, wait_for

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.llm import LLM
from streamkv.model.loader import LoadedModel
from streamkv.sampling_params import SamplingParams

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

QUESTION = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def offline(tiny_model_dir: str, tiny: LoadedModel) -> LLM:
    """The same weights offline, for the truth."""
    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"),
        cache=CacheConfig(num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN),
    )
    return LLM(config=config, loaded=tiny)


@pytest.fixture(autouse=True)
def pool_stays_whole(api_server: RunningServer) -> Iterator[None]:
    yield

    def idle() -> bool:
        snap = api_server.get("/api/stats").json()
        counts = snap["counts"]
        return snap["requests"]["running"] == 0 and counts["used"] == counts["pinned"] == counts["shared"] == 0

    wait_for(idle, timeout=30, what="running 0 and every block back in the pool")


def test_models_list_names_the_served_model(client: openai.OpenAI, api_server: RunningServer) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    card = models[0].model_dump()
    assert card["root"] == api_server.engine.config.model.model
    assert card["max_model_len"] == MAX_MODEL_LEN and card["owned_by"] == "streamkv"


def test_greedy_chat_equals_ws_chat_and_offline(client: openai.OpenAI, api_server: RunningServer, offline: LLM) -> None:
    prompt_ids = api_server.engine.chat.first_turn(QUESTION)
    truth = offline.generate([prompt_ids], SamplingParams(max_tokens=12, temperature=0))[0]
    with connect_chat(api_server) as ws:
        turn = chat_turn(ws, QUESTION, params={"max_tokens": 12, "temperature": 0}, timeout=60)
    assert turn.token_ids[0] == truth.outputs[0].token_ids
    assert turn.text[0] == truth.outputs[0].text

    messages = [{"role": "user", "content": QUESTION}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert resp.choices[0].message.content == truth.outputs[0].text
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == truth.outputs[0].finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(truth.outputs[0].token_ids)
    assert resp.usage.total_tokens == len(prompt_ids) + len(truth.outputs[0].token_ids)

    # Text parts are the same message; /tokenize renders exactly the prompt the chat route sends.
    parts = [
        {"role": "user", "content": [{"type": "text", "text": QUESTION[:10]}, {"type": "text", "text": QUESTION[10:]}]}
    ]
    again = client.chat.completions.create(model="tiny", messages=parts, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert again.choices[0].message.content == truth.outputs[0].text
    tokenized = post_json(api_server, "/tokenize", {"messages": messages}).json()
    assert tokenized == {"count": len(prompt_ids), "max_model_len": MAX_MODEL_LEN, "tokens": prompt_ids}


def test_streamed_chat_concatenates_to_the_non_streamed_text(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
    kwargs = {"model": "tiny", "messages": messages, "max_completion_tokens": 20, "temperature": 0}
    full = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == full.choices[0].message.content
    assert sum(c.choices[0].finish_reason is not None for c in content_chunks) == 1
    assert content_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert len(content_chunks) > 3  # streamed, not in one piece
    assert all(c.usage is None for c in content_chunks)
    usage = chunks[-1].usage  # the usage-only chunk comes last, with no choices
    assert chunks[-1].choices == [] and usage is not None and full.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)


def test_completions_with_token_ids_equal_offline_and_stream(client: openai.OpenAI, offline: LLM) -> None:
    ids = offline.tokenizer.encode("Once upon a time, in a land far away,")
    truth = offline.generate([ids], SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
    resp = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0)
    assert resp.choices[0].text == truth.text
    assert resp.usage is not None and resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(truth.token_ids)
    stream = client.completions.create(
        model="tiny", prompt=ids, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == truth.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(truth.token_ids)
    # A string prompt is tokenized as the offline API does.
    as_text = client.completions.create(model="tiny", prompt="Once upon a time, in a land far away,", max_tokens=10,
                                        temperature=0)  # fmt: skip
    assert as_text.choices[0].text == truth.text


def test_cached_tokens_on_a_repeated_prompt(client: openai.OpenAI) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 6  # several full 16-token blocks
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 16 <= cached < second.usage.prompt_tokens
    assert cached % 16 == 0


def test_n_3_with_a_seed_is_reproducible(client: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "prompt": "Pick a number:", "max_tokens": 8, "temperature": 1.0, "seed": 1234, "n": 3}
    a = client.completions.create(**kwargs)  # type: ignore[call-overload]
    b = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # three samples, not one repeated
    assert a.usage is not None and a.usage.completion_tokens == 24
    streamed = list(client.completions.create(**kwargs, stream=True))  # type: ignore[call-overload]
    finished = [c.choices[0].index for c in streamed if c.choices[0].finish_reason is not None]
    assert sorted(finished) == [0, 1, 2]  # each finished exactly once
    texts = {i: "".join(c.choices[0].text for c in streamed if c.choices[0].index == i) for i in range(3)}
    assert [texts[i] for i in range(3)] == [c.text for c in a.choices]
    other = client.completions.create(**{**kwargs, "seed": 99})  # type: ignore[call-overload]
    assert [c.text for c in other.choices] != [c.text for c in a.choices]


def test_several_prompts_index_choices_by_prompt_then_sample(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="tiny", prompt=["Hello", "Good morning"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in sorted(resp.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in resp.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy samples agree
    assert by_index[0] != by_index[2]
    assert resp.usage is not None and resp.usage.completion_tokens == 12
    alone = client.completions.create(model="tiny", prompt="Good morning", max_tokens=3, temperature=0)
    assert alone.choices[0].text == by_index[2]
    ids = client.completions.create(model="tiny", prompt=[[9690, 198], [19556]], max_tokens=2, temperature=0)
    assert sorted(c.index for c in ids.choices) == [0, 1]
    assert ids.usage is not None and ids.usage.prompt_tokens == 3


def test_logprobs_of_greedy_tokens_are_the_top_ones(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="tiny", prompt="Hello there", max_tokens=5, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and logprob < 0
        assert max(top.values()) == pytest.approx(logprob) and top[token] == pytest.approx(logprob)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_min_tokens_holds_off_stop_ids_and_echo_prepends_the_prompt(
    client: openai.OpenAI, api_server: RunningServer
) -> None:
    first = client.completions.create(model="tiny", prompt="Hello there", max_tokens=1, temperature=0)
    body = {"prompt": first.choices[0].text, "add_special_tokens": False}
    token = post_json(api_server, "/tokenize", body).json()["tokens"]
    assert len(token) == 1
    stop = {"stop_token_ids": token}
    stopped = client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=6, temperature=0, extra_body=stop
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1  # type: ignore[union-attr]
    held = client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=6, temperature=0, extra_body={**stop, "min_tokens": 4}
    )
    assert held.usage is not None and held.usage.completion_tokens >= 4
    ignored = client.completions.create(
        model="tiny",
        prompt="Hello there",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 6},
    )
    assert ignored.usage is not None and ignored.usage.completion_tokens == 6
    echoed = client.completions.create(model="tiny", prompt="Hello there", max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt="Hello there", max_tokens=3, temperature=0)
    assert echoed.choices[0].text == "Hello there" + plain.choices[0].text


def test_stop_strings_and_multibyte_text_match_ws_chat(client: openai.OpenAI, api_server: RunningServer) -> None:
    """Sampled (seeded) text of the near-uniform tiny model is full of multi-byte pieces."""
    params = {"max_tokens": 48, "temperature": 1.0, "seed": 7}
    with connect_chat(api_server) as ws:
        free = chat_turn(ws, "Say anything.", params=params, timeout=60)
        assert free.done is not None, free.frames
    text = free.text[0]
    assert any(ord(ch) > 127 for ch in text), text  # the test needs multi-byte characters to mean anything
    messages = [{"role": "user", "content": "Say anything."}]
    api = client.chat.completions.create(model="tiny", messages=messages, **params)  # type: ignore[arg-type]
    assert api.choices[0].message.content == text
    streamed = client.chat.completions.create(model="tiny", messages=messages, stream=True, **params)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text

    # A stop string across a token boundary: two tokens' worth of text from the middle of the answer.
    tokenizer = api_server.engine.tokenizer
    pieces = [tokenizer.decode(free.token_ids[0][: k + 1]) for k in range(len(free.token_ids[0]))]
    k = next(
        k
        for k in range(8, len(pieces) - 2)
        if "\ufffd" not in pieces[k + 1] and len(pieces[k]) > len(pieces[k - 1]) + 1
    )
    boundary = len(pieces[k])
    stop = text[boundary - 2 : boundary + 2]
    assert stop and stop not in text[: boundary - 2]
    with connect_chat(api_server) as ws:
        ws_stop = chat_turn(ws, "Say anything.", params={**params, "stop": [stop]}, timeout=60)
    api_stop = client.chat.completions.create(model="tiny", messages=messages, stop=[stop], **params)  # type: ignore[arg-type]
    streamed_stop = client.chat.completions.create(model="tiny", messages=messages, stop=[stop], stream=True, **params)  # type: ignore[arg-type]
    chunks = [c for c in streamed_stop if c.choices]
    assert ws_stop.text[0] == api_stop.choices[0].message.content == text[: boundary - 2]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ws_stop.text[0]
    assert ws_stop.done is not None and ws_stop.done["finish_reason"] == "stop"
    assert api_stop.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"


def test_detokenize_inverts_tokenize(api_server: RunningServer) -> None:
    text = "Grüße aus Köln, 東京 too."
    tokens = post_json(api_server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) > 5
    assert post_json(api_server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": text}


def test_streamed_logprobs_travel_with_their_text(client: openai.OpenAI) -> None:
    """A chunk's tokens are the tokens of its text, also while text is held back for a stop string."""
    kwargs = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "logprobs": 0}
    free = client.completions.create(**kwargs)  # type: ignore[call-overload]
    lp = free.choices[0].logprobs
    assert lp is not None and lp.tokens is not None
    pieces = list(lp.tokens)
    stop = None
    for k in range(2, len(pieces) - 1):
        a, b = pieces[k], pieces[k + 1]
        start, candidate = sum(len(p) for p in pieces[:k]), a[1:] + b[:1]
        if len(a) >= 2 and len(b) >= 2 and "\ufffd" not in a + b and free.choices[0].text.find(candidate) == start + 1:
            stop = candidate
            break
    if stop is None:
        pytest.skip("the tiny model's answer has no two adjacent multi-character tokens")
    chunks = [c for c in client.completions.create(**kwargs, stop=[stop], stream=True) if c.choices]  # type: ignore[call-overload]
    assert chunks[-1].choices[0].finish_reason == "stop"
    for c in chunks[:-1]:
        tokens = c.choices[0].logprobs.tokens if c.choices[0].logprobs is not None else []
        assert "".join(tokens or []) == c.choices[0].text, c
    assert "".join(c.choices[0].text for c in chunks) == free.choices[0].text[: free.choices[0].text.find(stop)]
