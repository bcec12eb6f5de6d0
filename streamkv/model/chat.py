"""Chat prompts from the tokenizer's own chat template, turn by turn.

A session keeps its history as token ids (and its KV cache as pinned blocks),
so turn N+1 must only *append* ids::

    turn 1 prompt   = render([system?, user1], generation prompt)
    history         = turn 1 prompt ids + generated ids (ending on EOS or cut by max_tokens)
    turn 2 appended = close the assistant turn (unless EOS already did)
                      + render(.., user2, generation prompt) minus render(..)

The appended text is found the standard way: render a reference conversation
with and without the new user turn and take the text suffix; the closing text
of an assistant turn is what the template writes after an assistant message's
content (``<|im_end|>\\n`` for ChatML). Suffixes are tokenized without special
tokens, so no BOS is ever added mid-conversation.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

# Contents of the reference conversation's earlier turns: any text the template
# copies verbatim works; these never collide with template syntax.
_USER = "\u2063streamkv-user\u2063"
_ASSISTANT = "\u2063streamkv-assistant\u2063"
# Placeholder for message content i; only ever rendered, never read from a message.
_SLOT = re.compile("\u2063streamkv-slot-(\\d+)\u2063")


def _slot(i: int) -> str:
    return f"\u2063streamkv-slot-{i}\u2063"


class ChatFormatter:
    """Prompt ids for a conversation under ``tokenizer.chat_template``.

    Args:
        tokenizer: a tokenizer with a chat template.

    Raises:
        ValueError: the tokenizer has no chat template, or the template does
            not render a conversation as a prefix of its continuation.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.content}
        self._added_ids = added
        # the template's own special tokens: matched in template text only, longest first
        self._added_re = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
            if added
            else None
        )
        self._special_prefix = _auto_special_prefix(tokenizer)
        before = self._render([_user(_USER), _assistant(_ASSISTANT)], add_generation_prompt=False)
        after = self._render([_user(_USER), _assistant(_ASSISTANT), _user(_USER)], add_generation_prompt=True)
        if not after.startswith(before) or _ASSISTANT not in before:
            raise ValueError("the chat template does not render a conversation as a prefix of its continuation")
        closing = before[before.rindex(_ASSISTANT) + len(_ASSISTANT) :]
        eos = tokenizer.eos_token or ""
        self._reference = before
        self._closing = closing
        # When generation stops on EOS, the EOS token already sits in the history.
        self._closing_after_eos = closing[len(eos) :] if eos and closing.startswith(eos) else closing

    def first_turn(self, user: str, system: str | None = None) -> list[int]:
        """Prompt ids of a new conversation, generation prompt included.

        The special prefix (BOS) appears exactly once, whether the template
        writes it, the tokenizer adds it, or both would.
        """
        contents = [user] if system is None else [system, user]
        messages = ([{"role": "system", "content": _slot(0)}] if system is not None else []) + [
            _user(_slot(len(contents) - 1))
        ]
        text = self._render(messages, add_generation_prompt=True)
        ids = self._encode_filled(text, contents)
        prefix = self._special_prefix
        if prefix and ids[: len(prefix)] != prefix:
            ids = prefix + ids
        return ids

    def conversation(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt ids of a whole conversation (``{"role", "content"}`` dicts), generation prompt included.

        The OpenAI API's messages; ``[system?, user]`` gives exactly :meth:`first_turn`'s ids.
        Contents are tokenized as text, never as control tokens (no forged turns).
        """
        slotted = [{**m, "content": _slot(i)} for i, m in enumerate(messages)]
        text = self._render(slotted, add_generation_prompt=True)
        ids = self._encode_filled(text, [m["content"] for m in messages])
        prefix = self._special_prefix
        if prefix and ids[: len(prefix)] != prefix:
            ids = prefix + ids
        return ids

    def next_turn(self, user: str, last_finished_on_eos: bool) -> list[int]:
        """Ids to append to ``previous prompt ids + generated ids`` for a new user turn.

        Args:
            user: the new user message.
            last_finished_on_eos: the previous generation's last id is the EOS
                token that opens the template's end-of-turn text (so only the
                rest of that text is appended); ``False`` when it stopped for
                another reason (max_tokens, a stop string) and the whole
                end-of-turn text is needed.

        Returns:
            Ids whose text, after the history's, equals the template rendering
            of the whole conversation plus the generation prompt.
        """
        return self.next_messages([_user(user)], last_finished_on_eos)

    def next_messages(self, messages: list[dict[str, str]], last_finished_on_eos: bool) -> list[int]:
        """:meth:`next_turn` for several new messages (``{"role", "content"}`` dicts, in order).

        The ids to append to ``previous prompt ids + generated ids`` so that
        the text equals the template rendering of the whole conversation
        with ``messages`` after it, plus the generation prompt; contents are
        tokenized as text, never as control tokens.

        Raises:
            ValueError: the template renders the earlier turns differently
                once these messages follow.
            jinja2.TemplateError: the template refuses them (e.g. a role order it does not allow).
        """
        closing = self._closing_after_eos if last_finished_on_eos else self._closing
        # The template renders the reference conversation's earlier turns identically
        # with and without the new turns, so the suffix is the new turns alone.
        slotted = [{**m, "content": _slot(i)} for i, m in enumerate(messages)]
        after = self._render([_user(_USER), _assistant(_ASSISTANT), *slotted], add_generation_prompt=True)
        if not after.startswith(self._reference):
            raise ValueError("the chat template renders earlier turns differently once these messages follow")
        return self._encode_filled(closing + after[len(self._reference) :], [m["content"] for m in messages])

    # --- internals ---------------------------------------------------------

    def _render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert isinstance(text, str)
        return text

    def _encode_filled(self, template_text: str, contents: Sequence[str]) -> list[int]:
        """Ids of ``template_text`` with slot i replaced by ``contents[i]``.

        Added tokens are matched in the template's text only; the text between
        them (template text and contents alike) is tokenized with special-token
        matching off, which is what the tokenizer itself does to the text
        between special tokens, so a content without special-token text gets
        exactly the ids of the plain rendering.
        """
        ids: list[int] = []
        run: list[str] = []

        def flush() -> None:
            text = "".join(run)
            run.clear()
            if text:
                enc = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)
                ids.extend(enc["input_ids"])

        for k, part in enumerate(_SLOT.split(template_text)):
            if k % 2:  # a slot index
                run.append(contents[int(part)])
                continue
            pieces = self._added_re.split(part) if self._added_re is not None else [part]
            for m, piece in enumerate(pieces):
                if m % 2:
                    flush()
                    ids.append(self._added_ids[piece])
                else:
                    run.append(piece)
        flush()
        return ids


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def _assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


def _auto_special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids the tokenizer itself puts before any text (e.g. ``[bos]``), possibly empty."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []
