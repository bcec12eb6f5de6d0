"""The Responses API's server objects, in the shapes the ``openai`` SDK parses.

:class:`ResponseDraft` is one response as it is generated: it builds the
``Response`` object (``GET /v1/responses/{id}``, the body of a non-streamed
``POST``) and the stream events, numbered by ``sequence_number``, in this
order::

    response.created, response.in_progress,
    response.output_item.added, response.content_part.added,
    response.output_text.delta ...,
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed | response.incomplete   (usage.input_tokens_details.cached_tokens)

On a WebSocket every event also carries the create's ``stream_id`` (when it had one).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from streamkv.outputs import FinishReason, Usage
from streamkv.server.responses.protocol import ResponseCreate

Event = dict[str, Any]


def new_response_id() -> str:
    """An unguessable id: holding it is enough to continue or fetch the response."""
    return "resp_" + secrets.token_urlsafe(24)


@dataclass(slots=True)
class ResponseDraft:
    """One response while it is generated, and its events.

    Args:
        req: the create request.
        model: the served model's id.
        stream_id: the WebSocket lane, echoed on every event (``None``: none / HTTP).
    """

    req: ResponseCreate
    model: str
    stream_id: str | None = None
    response_id: str = field(default_factory=new_response_id)
    item_id: str = field(default_factory=lambda: "msg_" + secrets.token_urlsafe(16))
    created_at: float = field(default_factory=time.time)
    text: str = ""
    usage: Usage | None = None
    finish_reason: FinishReason | None = None
    completed_at: float | None = None
    _seq: int = 0

    # ------------------------------------------------------------- objects

    @property
    def status(self) -> str:
        """``in_progress`` while generating; ``completed``; ``incomplete`` when cut by a token limit;
        ``cancelled`` when stopped before its end."""
        if self.finish_reason is None:
            return "in_progress"
        if self.finish_reason is FinishReason.LENGTH:
            return "incomplete"
        if self.finish_reason is FinishReason.CANCELLED:
            return "cancelled"
        return "completed"

    def item(self, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self._part(self.text)]
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def response(self) -> dict[str, Any]:
        """The ``Response`` object as it stands."""
        status = self.status
        done = status != "in_progress"
        req = self.req
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": int(self.created_at),
            "completed_at": int(self.completed_at) if self.completed_at is not None else None,
            "status": status,
            "model": self.model,
            "output": [self.item("completed" if status == "completed" else "incomplete")] if done else [],
            "output_text": self.text if done else "",
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "metadata": dict(req.metadata or {}),
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "temperature": float(req.temperature) if req.temperature is not None else 1.0,
            "top_p": float(req.top_p) if req.top_p is not None else 1.0,
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "store": req.store,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": _usage(self.usage) if done and self.usage is not None else None,
        }

    # -------------------------------------------------------------- events

    def opening(self) -> list[Event]:
        """``response.created`` through ``response.content_part.added``."""
        created = self.response()
        return [
            self._event("response.created", response=created),
            self._event("response.in_progress", response=created),
            self._event("response.output_item.added", output_index=0, item=self.item("in_progress")),
            self._event(
                "response.content_part.added",
                item_id=self.item_id,
                output_index=0,
                content_index=0,
                part=self._part(""),
            ),  # fmt: skip
        ]

    def delta(self, text: str) -> Event:
        self.text += text
        return self._event(
            "response.output_text.delta",
            item_id=self.item_id, output_index=0, content_index=0, delta=text, logprobs=[],
        )  # fmt: skip

    def closing(self, finish_reason: FinishReason, usage: Usage) -> list[Event]:
        """The ``*.done`` events and ``response.completed`` (or ``response.incomplete``)."""
        self.finish_reason = finish_reason
        self.usage = usage
        self.completed_at = time.time()
        item_status = "completed" if self.status == "completed" else "incomplete"
        final = self.response()
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return [
            self._event(
                "response.output_text.done",
                item_id=self.item_id,
                output_index=0,
                content_index=0,
                text=self.text,
                logprobs=[],
            ),  # fmt: skip
            self._event(
                "response.content_part.done",
                item_id=self.item_id,
                output_index=0,
                content_index=0,
                part=self._part(self.text),
            ),  # fmt: skip
            self._event("response.output_item.done", output_index=0, item=self.item(item_status)),
            self._event(kind, response=final),
        ]

    def _event(self, kind: str, **fields: Any) -> Event:
        event: Event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        if self.stream_id is not None:
            event["stream_id"] = self.stream_id
        return event

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def error_event(status: int, code: str, message: str, param: str | None = None, stream_id: str | None = None) -> Event:
    """A WebSocket ``error`` event: ``{type: "error", status, error: {type, code, message, param}}``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 404:
        kind = "not_found_error"
    event: Event = {
        "type": "error",
        "status": status,
        "error": {"type": kind, "code": code, "message": message, "param": param},
    }
    if stream_id is not None:
        event["stream_id"] = stream_id
    return event
