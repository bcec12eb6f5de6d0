"""Incremental detokenization with stop strings.

Two rules clients can rely on:

1. No delta carries a broken UTF-8 character: a byte-level BPE token can end
   mid-character, so text ending in U+FFFD is held until the next token
   completes it (the prefix/read offset scheme of vLLM and TGI).
2. No delta carries text that a stop string later swallows: the tail of the
   text that could still begin a stop string is held back, and flushed when
   generation ends another way (EOS, max_tokens).

Concatenating every delta gives the final text.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

# how many tokens of left context to decode with, so that tokenizers that
# merge leading spaces decode the new tokens as they appear in the whole text
_CONTEXT_TOKENS = 6


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
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = list(prompt_tail[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all decoded output text (before stop truncation)
        self.num_emitted = 0  # characters of self.text already returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Feed one token; return ``(delta, stopped)``.

        ``stopped`` is True when a stop string appeared: the delta then ends
        right before it and the sequence must finish with reason ``stop``.
        """
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        if self.stop:
            start = max(0, self.num_emitted - self._max_stop)
            cut = None
            for s in self.stop:
                i = self.text.find(s, start)
                if i != -1 and (cut is None or i < cut):
                    cut = i
            if cut is not None:
                self.text = self.text[:cut]
                return self._emit(len(self.text)), True
            return self._emit(len(self.text) - self._held_back()), False
        return self._emit(len(self.text)), False

    def flush(self) -> str:
        """Return everything still held back (generation ended without a stop string)."""
        return self._emit(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        text = self.text
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.num_emitted)
        delta = self.text[self.num_emitted : upto]
        self.num_emitted = upto
        return delta
