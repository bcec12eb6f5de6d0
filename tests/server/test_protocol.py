from __future__ import annotations

import orjson
import pytest
from bad_frames import BAD_FRAMES

from streamkv.outputs import Usage
from streamkv.server import protocol
from streamkv.server.protocol import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    MAX_FRAME_BYTES,
    CancelFrame,
    ChatFrame,
    FrameError,
    ResetFrame,
    parse_frame,
)


@pytest.mark.parametrize(("raw", "code", "word"), [c[1:] for c in BAD_FRAMES], ids=[c[0] for c in BAD_FRAMES])
def test_bad_frames_get_their_code_and_name_the_field(raw: str | bytes, code: str, word: str) -> None:
    with pytest.raises(FrameError) as info:
        parse_frame(raw)
    assert info.value.code == code
    assert word in info.value.message


def test_chat_defaults() -> None:
    frame = parse_frame('{"type": "chat", "content": "hi"}')
    assert isinstance(frame, ChatFrame)
    assert frame.content == "hi"
    assert frame.session_id is None and frame.system is None and frame.resumable is None
    assert frame.params.max_tokens == DEFAULT_MAX_TOKENS
    assert frame.params.temperature == DEFAULT_TEMPERATURE
    assert frame.params.n == 1 and frame.params.top_k is None and frame.params.stop == ()


def test_chat_all_fields() -> None:
    raw = {
        "type": "chat",
        "content": "hi",
        "session_id": "abc",
        "system": "be brief",
        "resumable": True,
        "params": {
            "max_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 40,
            "seed": 3,
            "stop": "\n",
            "n": 2,
            "stop_token_ids": [9],
            "ignore_eos": True,
        },
    }
    frame = parse_frame(orjson.dumps(raw))  # binary frames work too
    assert isinstance(frame, ChatFrame)
    assert (frame.session_id, frame.system, frame.resumable) == ("abc", "be brief", True)
    p = frame.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.n) == (7, 0.0, 0.5, 40, 3, 2)
    assert p.stop == ("\n",) and p.stop_token_ids == (9,) and p.ignore_eos and p.greedy


def test_nulls_mean_defaults_or_unbounded() -> None:
    frame = parse_frame('{"type":"chat","content":"hi","session_id":null,"params":{"max_tokens":null,"seed":null}}')
    assert isinstance(frame, ChatFrame)
    assert frame.params.max_tokens is None and frame.params.seed is None


def test_cancel_and_reset() -> None:
    assert isinstance(parse_frame('{"type": "cancel"}'), CancelFrame)
    assert isinstance(parse_frame('{"type": "reset"}'), ResetFrame)


def test_frame_size_counts_utf8_bytes() -> None:
    # 3 bytes per char: under the limit in characters, over it in bytes.
    content = "€" * (MAX_FRAME_BYTES // 3)
    with pytest.raises(FrameError) as info:
        parse_frame(orjson.dumps({"type": "chat", "content": content}).decode())
    assert info.value.code == "frame_too_large"
    ok = "€" * (MAX_FRAME_BYTES // 3 - 20)
    assert isinstance(parse_frame(orjson.dumps({"type": "chat", "content": ok}).decode()), ChatFrame)


def test_non_finite_numbers_are_not_json() -> None:
    with pytest.raises(FrameError) as info:
        parse_frame('{"type":"chat","content":"hi","params":{"temperature":NaN}}')
    assert info.value.code == "invalid_json"


def test_server_frames() -> None:
    done = protocol.done_frame(["length", "stop"], Usage(10, 4, 6), 0.0125, 0.5)
    assert done == {
        "type": "done",
        "finish_reason": "length",
        "finish_reasons": ["length", "stop"],
        "usage": {"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 6},
        "timings": {"ttft_ms": 12.5, "total_ms": 500.0},
    }
    assert protocol.done_frame(["cancelled"], Usage(1, 0, 0), None, 0.1)["timings"]["ttft_ms"] is None
    ids = [1, 2]
    delta = protocol.delta_frame(0, "a", ids)
    delta["token_ids"].append(3)
    assert ids == [1, 2], "the frame must not alias the engine's list"
    assert protocol.error_frame("x", "y") == {"type": "error", "code": "x", "message": "y"}
    assert protocol.session_frame("s", resumed=True, num_turns=2, num_tokens=40) == {
        "type": "session", "session_id": "s", "resumed": True, "num_turns": 2, "num_tokens": 40
    }


@pytest.mark.parametrize("top_k", ["null", "-1"])
def test_top_k_all_is_none(top_k: str) -> None:
    """``null`` keeps every token; ``-1`` (what the web UI and older clients send) means the same."""
    frame = parse_frame('{"type":"chat","content":"hi","params":{"top_k":' + top_k + "}}")
    assert isinstance(frame, ChatFrame) and frame.params.top_k is None


def test_top_k_below_minus_one_is_refused() -> None:
    with pytest.raises(FrameError) as info:
        parse_frame('{"type":"chat","content":"hi","params":{"top_k":-2}}')
    assert info.value.code == "invalid_params" and "top_k" in info.value.message
