"""Incremental detokenization: no broken UTF-8, no withdrawn text, stop strings honoured."""

from __future__ import annotations

import pytest

from streamkv.detokenizer import IncrementalDetokenizer

TEXTS = ["naïve café 🙂 日本語 👩‍💻", "Zürich – «quotes» and emoji 🎉🎉 done", "plain ascii words"]


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_one_token_at_a_time(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add_token(t)[0] for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_stop_string_spanning_tokens_is_never_streamed(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("alpha beta gamma delta alpha beta gamma delta", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["a gam"])
    streamed = ""
    for t in ids:
        delta, stopped = detok.add_token(t)
        streamed += delta
        assert "a gam" not in streamed
        if stopped:
            break
    assert stopped and streamed == "alpha bet"


def test_held_back_text_is_flushed_when_generation_ends_otherwise(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("the answer is a", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["a gam"])
    streamed = "".join(detok.add_token(t)[0] for t in ids)
    assert streamed == "the answer is "  # "a" might begin the stop string
    assert streamed + detok.flush() == "the answer is a"


def test_earliest_of_several_stop_strings_wins(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["four", "two"])
    out = ""
    for t in ids:
        delta, stopped = detok.add_token(t)
        out += delta
        if stopped:
            break
    assert stopped and out == "one "
