"""Sampled-token logprobs in the two OpenAI shapes (legacy completions and chat).

Token strings are each id decoded on its own (vLLM's default); ``bytes`` are
that string's UTF-8 bytes, so a token that ends mid-character shows U+FFFD.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from streamkv.outputs import TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class LogprobFormatter:
    """Formats :class:`TokenLogprob` records; caches token strings."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._strings: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        s = self._strings.get(token_id)
        if s is None:
            # one flat id list decodes to one string (the list[str] in decode's type is for batches)
            text = self._tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            s = cast(str, text)
            if len(self._strings) < 65536:
                self._strings[token_id] = s
        return s

    def completion(self, records: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
        """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (``/v1/completions``)."""
        tokens = [self.token(r.token_id) for r in records]
        offsets = []
        for t in tokens:
            offsets.append(text_offset)
            text_offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{self.token(t): lp for t, lp in r.top} for r in records],
            "text_offset": offsets,
        }

    def chat(self, records: list[TokenLogprob]) -> dict[str, Any]:
        """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`` (``/v1/chat/completions``)."""
        return {"content": [self._chat_entry(r.token_id, r.logprob, r.top) for r in records]}

    def _chat_entry(self, token_id: int, logprob: float, top: list[tuple[int, float]] | None) -> dict[str, Any]:
        s = self.token(token_id)
        entry: dict[str, Any] = {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}
        if top is not None:
            entry["top_logprobs"] = [self._chat_entry(t, lp, None) for t, lp in top]
        return entry
