"""Incremental detokenization: no broken UTF-8, no withdrawn text, stop strings honoured."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkv.detokenizer import IncrementalDetokenizer, StopMatcher, text_decoder

TEXTS = ["naïve café 🙂 日本語 👩‍💻", "Zürich – «quotes» and emoji 🎉🎉 done", "plain ascii words"]


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_one_token_at_a_time(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add_token(t).text for t in ids]
    deltas.append(detok.flush().text)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_stop_string_spanning_tokens_is_never_streamed(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("alpha beta gamma delta alpha beta gamma delta", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["a gam"])
    streamed = ""
    for t in ids:
        d = detok.add_token(t)
        delta, stopped = d.text, d.stopped
        streamed += delta
        assert "a gam" not in streamed
        if stopped:
            break
    assert stopped and streamed == "alpha bet"


def test_held_back_text_is_flushed_when_generation_ends_otherwise(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("the answer is a", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["a gam"])
    streamed = "".join(detok.add_token(t).text for t in ids)
    assert streamed == "the answer is"  # the token " a" might begin the stop string: held back whole
    assert streamed + detok.flush().text == "the answer is a"


def test_earliest_of_several_stop_strings_wins(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["four", "two"])
    out = ""
    for t in ids:
        d = detok.add_token(t)
        delta, stopped = d.text, d.stopped
        out += delta
        if stopped:
            break
    assert stopped and out == "one "


def test_long_stop_strings_cost_per_token_not_per_text(smollm2_tokenizer):
    # 16 stop strings of 60,000 characters over 2,000 tokens once took a minute of
    # engine-thread time (an O(stop length^2) hold-back scan per token). Bounded
    # by a deadline so a regression fails instead of hanging.
    tok = smollm2_tokenizer
    stops = [f"{i:02d}" + "x" * 59_998 for i in range(16)]
    ids = tok.encode(" the quick brown fox jumps over the lazy dog" * 250, add_special_tokens=False)[:2000]
    assert len(ids) == 2000
    detok = IncrementalDetokenizer(tok, stop=stops)
    deadline = time.monotonic() + 20.0  # generous: the fix takes well under a second, even on a loaded machine
    out = []
    for t in ids:
        d = detok.add_token(t)
        delta, stopped = d.text, d.stopped
        out.append(delta)
        assert not stopped
        assert time.monotonic() < deadline, f"stop-string matching too slow after {len(out)} tokens"
    out.append(detok.flush().text)
    assert "".join(out) == tok.decode(ids)


def test_stop_string_that_overlaps_itself_is_found(smollm2_tokenizer):
    # KMP: after "aab" fails on "aaab" the automaton must fall back, not restart
    tok = smollm2_tokenizer
    ids = tok.encode("xx aaab yy", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["aab"])
    out = ""
    for t in ids:
        d = detok.add_token(t)
        delta, stopped = d.text, d.stopped
        out += delta
        if stopped:
            break
    assert stopped and out == "xx a"


def test_stop_string_with_a_repeated_prefix_is_held_back(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("ab ab ab", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["ab ab c"])
    streamed = "".join(detok.add_token(t).text for t in ids)
    assert streamed == "ab"  # " ab ab" ends in what may still begin the stop string: whole tokens held
    assert streamed + detok.flush().text == "ab ab ab"


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.text("ab", max_size=4), max_size=12),
    stop=st.lists(st.text("ab", min_size=1, max_size=5), min_size=1, max_size=3),
)
def test_stop_matcher_agrees_with_a_naive_scan(chunks: list[str], stop: list[str]) -> None:
    matcher = StopMatcher(stop)
    text = ""
    for chunk in chunks:
        cut = matcher.feed(chunk, len(text))
        text += chunk
        found = [text.find(s) for s in stop if s in text]  # earlier chunks completed none
        if found:
            assert cut == min(found)
            return
        assert cut is None
        held = max((k for s in stop for k in range(len(s)) if text.endswith(s[:k])), default=0)
        assert matcher.held_back() == held


def _check_ids_match_text(tok, text: str, stop: list[str]) -> list[tuple[str, list[int]]]:
    """Stream ``text``'s tokens; every delta's ids decode to its text (but a stop's own tokens)."""
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=stop)
    deltas = []
    for t in ids:
        d = detok.add_token(t)
        deltas.append((d.text, d.token_ids, d.stopped))
        if d.stopped:
            break
    else:
        d = detok.flush()
        deltas.append((d.text, d.token_ids, False))
    for piece, piece_ids, stopped in deltas:
        decoded = tok.decode(piece_ids)
        if stopped:  # the stop string's tokens are released with it; its text is not sent
            assert decoded.startswith(piece) and any(s in decoded for s in stop), (piece, decoded)
        else:
            assert decoded == piece, (piece, piece_ids, decoded)
    assert [t for _, piece_ids, _ in deltas for t in piece_ids] == ids[: sum(len(i) for _, i, _ in deltas)]
    return [(piece, piece_ids) for piece, piece_ids, _ in deltas]


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("alpha beta gamma delta alpha beta gamma delta", ["a gam"]),
        ("the answer is a", ["a gam"]),
        ("ab ab ab ab c", ["ab ab c"]),
        ("naïve café 🙂 日本語 👩‍💻 and more", ["日本x", "🙂 日"]),
        ("Zürich – «quotes» and emoji 🎉🎉 done", ["🎉 d", "emoji 🎉🎉 x"]),
    ],
)
def test_token_ids_are_held_back_with_their_text(smollm2_tokenizer, text: str, stop: list[str]) -> None:
    deltas = _check_ids_match_text(smollm2_tokenizer, text, stop)
    assert any(piece == "" and not ids for piece, ids in deltas), "some text was held back"


@settings(max_examples=100, deadline=None)
@given(
    words=st.lists(st.sampled_from(["ab", " ab", "c", " c", "é", " 🙂", "日本", "x"]), min_size=1, max_size=12),
    stop=st.lists(st.text("abc é🙂日", min_size=1, max_size=4), min_size=1, max_size=2),
)
def test_every_delta_decodes_to_its_text(smollm2_tokenizer, words: list[str], stop: list[str]) -> None:
    _check_ids_match_text(smollm2_tokenizer, "".join(words), stop)


@settings(max_examples=150, deadline=None)
@given(picks=st.lists(st.integers(0, 10**9), min_size=0, max_size=12))
def test_the_direct_decode_is_transformers_decode(smollm2_tokenizer, picks: list[int]) -> None:
    # Any ids, special ones and broken UTF-8 halves included: the Rust tokenizer's decode taken directly
    tok = smollm2_tokenizer
    pool = [*tok.all_special_ids, *tok.encode(" ".join(TEXTS), add_special_tokens=False)]
    ids = [pool[i % len(pool)] if i % 3 else i % len(tok) for i in picks]
    want = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert text_decoder(tok)(ids) == want


def test_the_direct_decode_does_not_call_transformers(smollm2_tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("plain words", add_special_tokens=False)

    def refuse(*args: object, **kwargs: object) -> str:
        raise AssertionError("transformers' decode was called")

    monkeypatch.setattr(tok, "decode", refuse)  # the instance only: the class's decode is still transformers'
    assert text_decoder(tok)(ids) == "plain words"


def test_a_tokenizer_with_its_own_decode_keeps_it(smollm2_tokenizer) -> None:
    class Shouting(type(smollm2_tokenizer)):  # type: ignore[misc]
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):  # type: ignore[no-untyped-def]
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    tok = smollm2_tokenizer
    ids = tok.encode("plain words", add_special_tokens=False)
    shouting = Shouting.__new__(Shouting)
    shouting.__dict__.update(tok.__dict__)
    assert text_decoder(shouting)(ids) == "PLAIN WORDS"
    assert text_decoder(tok)(ids) == "plain words"
