"""Incremental detokenization with stop strings.

Two rules clients can rely on:

1. No delta carries a broken UTF-8 character: a byte-level BPE token can end
   mid-character, so text ending in U+FFFD is held until the next token
   completes it (the prefix/read offset scheme of vLLM and TGI).
2. No delta carries text that a stop string later swallows: the tail of the
   text that could still begin a stop string is held back, and flushed when
   generation ends another way (EOS, max_tokens).

Concatenating every delta gives the final text.

Stop strings are matched by one Knuth-Morris-Pratt automaton each, fed the
new characters only: a token costs O(new characters x stop strings)
amortized, whatever the length of the text or of the stop strings (the
tables cost O(total stop-string length) once per sequence).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase

# how many tokens of left context to decode with, so that tokenizers that
# merge leading spaces decode the new tokens as they appear in the whole text
_CONTEXT_TOKENS = 6


class StopMatcher:
    """Finds stop strings in a growing text, one character at a time.

    ``states[i]`` is the length of the longest prefix of ``stop[i]`` that is a
    suffix of the text fed so far (the KMP automaton's state).

    Args:
        stop: non-empty stop strings.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        self._failure = [_failure_table(s) for s in self.stop]
        self.states = [0] * len(self.stop)

    def feed(self, text: str, offset: int) -> int | None:
        """Feed ``text``, which starts at index ``offset`` of the whole text.

        Returns the start index (in the whole text) of the earliest-starting
        stop string that completes within ``text``, else ``None``.
        """
        cut = None
        for i, s in enumerate(self.stop):
            state, fail, n = self.states[i], self._failure[i], len(s)
            for j, ch in enumerate(text):
                while state and s[state] != ch:
                    state = fail[state - 1]
                if s[state] == ch:
                    state += 1
                if state == n:
                    start = offset + j + 1 - n
                    cut = start if cut is None else min(cut, start)
                    state = fail[state - 1]
                    break
            self.states[i] = state
        return cut

    def held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        return max(self.states, default=0)


def _failure_table(s: str) -> array:
    """KMP failure function: ``f[k]`` = longest proper border of ``s[: k + 1]``."""
    f = array("i", bytes(4 * len(s)))
    k = 0
    for q in range(1, len(s)):
        while k and s[k] != s[q]:
            k = f[k - 1]
        if s[k] == s[q]:
            k += 1
        f[q] = k
    return f


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text deltas.

    Args:
        tokenizer: a transformers tokenizer.
        stop: stop strings (the match is removed from the text).
        prompt_tail: last few prompt token ids, for decoding context.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = (), prompt_tail: Sequence[int] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._matcher = StopMatcher(self.stop) if self.stop else None
        self._ids: list[int] = list(prompt_tail[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all decoded output text (before stop truncation)
        self.num_emitted = 0  # characters of self.text already returned

    def _decode(self, ids: list[int]) -> str:
        # one flat id list decodes to one string (the list[str] in decode's type is for batches)
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Feed one token; return ``(delta, stopped)``.

        ``stopped`` is True when a stop string appeared: the delta then ends
        right before it and the sequence must finish with reason ``stop``.
        """
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        piece = ""
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            piece = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        offset = len(self.text)
        self.text += piece
        if self._matcher is not None:
            cut = self._matcher.feed(piece, offset) if piece else None
            if cut is not None:
                self.text = self.text[:cut]
                return self._emit(len(self.text)), True
            return self._emit(len(self.text) - self._matcher.held_back()), False
        return self._emit(len(self.text)), False

    def flush(self) -> str:
        """Return everything still held back (generation ended without a stop string)."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.num_emitted)
        delta = self.text[self.num_emitted : upto]
        self.num_emitted = upto
        return delta
