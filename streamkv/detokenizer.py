"""Incremental detokenization with stop strings.

Two rules clients can rely on:

1. No delta carries a broken UTF-8 character: a byte-level BPE token can end
   mid-character, so text ending in U+FFFD is held until the next token
   completes it (the prefix/read offset scheme of vLLM and TGI).
2. No delta carries text that a stop string later swallows: the tail of the
   text that could still begin a stop string is held back, and flushed when
   generation ends another way (EOS, max_tokens).

Concatenating every delta gives the final text.

Token ids travel with their text: a delta releases the ids of exactly the
tokens whose text it completes, so text held back holds its ids back too,
and each delta's ids decode to its text. Hence the hold-back is rounded out
to whole tokens. The one exception is the delta that ends on a stop string:
it releases every remaining id, the stop string's tokens included (they are
part of the sequence), while its text ends before the stop string.

Stop strings are matched by one Knuth-Morris-Pratt automaton each, fed the
new characters only: a token costs O(new characters x stop strings)
amortized, whatever the length of the text or of the stop strings (the
tables cost O(total stop-string length) once per sequence).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# how many tokens of left context to decode with, so that tokenizers that
# merge leading spaces decode the new tokens as they appear in the whole text
_CONTEXT_TOKENS = 6


def text_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """``ids -> text`` as ``tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)``.

    For a fast (``tokenizers``) tokenizer whose ``decode`` and ``_decode`` are
    transformers' own (``PreTrainedTokenizerFast``, 4.x and 5.x, where it is
    ``TokenizersBackend``), that call is exactly the Rust tokenizer's ``decode``,
    which is taken directly: 1.4 us against 4.0 for 7 ids here, and every
    output token decodes twice (docs/benchmarks.md, "Round 39"). Any other
    tokenizer goes through its ``decode``.
    """
    kind = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and backend is not None
        and kind._decode is PreTrainedTokenizerFast._decode
        and kind.decode is PreTrainedTokenizerBase.decode
    ):
        decode = backend.decode
        return lambda ids: cast(str, decode(ids, skip_special_tokens=True))
    # one flat id list decodes to one string (the list[str] in decode's type is for batches)
    return lambda ids: cast(str, tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))


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


@dataclass(slots=True)
class DetokenizedDelta:
    """What one token (or a flush) releases.

    Attributes:
        text: characters released.
        token_ids: ids of the tokens whose text ``text`` completes (see the module docstring).
        stopped: a stop string appeared; ``text`` ends right before it.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    stopped: bool = False


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
        self._decode = text_decoder(tokenizer)
        self.stop = tuple(stop)
        self._matcher = StopMatcher(self.stop) if self.stop else None
        self._ids: list[int] = list(prompt_tail[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all decoded output text (before stop truncation)
        self.num_emitted = 0  # characters of self.text already returned
        # Output tokens not yet released, oldest first, and where each one's text
        # ends in self.text: None until it is decoded (an incomplete UTF-8 character).
        self._pending_ids: list[int] = []
        self._pending_ends: list[int | None] = []

    def add_token(self, token_id: int) -> DetokenizedDelta:
        """Feed one token; return what it releases.

        ``stopped`` is True when a stop string appeared: the text then ends
        right before it, every remaining token id is released, and the
        sequence must finish with reason ``stop``.
        """
        self._ids.append(token_id)
        self._pending_ids.append(token_id)
        self._pending_ends.append(None)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        piece = ""
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            piece = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        offset = len(self.text)
        self.text += piece
        if piece:
            ends = self._pending_ends
            i = len(ends) - 1
            while i >= 0 and ends[i] is None:
                ends[i] = len(self.text)
                i -= 1
        if self._matcher is not None:
            cut = self._matcher.feed(piece, offset) if piece else None
            if cut is not None:
                self.text = self.text[:cut]
                delta = self._emit(len(self.text), all_ids=True)
                delta.stopped = True
                return delta
            return self._emit(len(self.text) - self._matcher.held_back())
        return self._emit(len(self.text))

    def flush(self) -> DetokenizedDelta:
        """Release everything still held back (generation ended without a stop string)."""
        return self._emit(len(self.text), all_ids=True)

    def _emit(self, upto: int, all_ids: bool = False) -> DetokenizedDelta:
        """Release the whole tokens whose text ends at or before ``upto`` (all of them with ``all_ids``)."""
        n = len(self._pending_ids)
        if not all_ids:
            n, end = 0, self.num_emitted
            for token_end in self._pending_ends:
                if token_end is None or token_end > upto:
                    break
                n, end = n + 1, token_end
            upto = end
        ids = self._pending_ids[:n]
        del self._pending_ids[:n], self._pending_ends[:n]
        upto = max(upto, self.num_emitted)
        text = self.text[self.num_emitted : upto]
        self.num_emitted = upto
        return DetokenizedDelta(text, ids)
