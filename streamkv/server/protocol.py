"""The ``/ws/chat`` wire format: client frames parsed and validated into records.

Client frames (JSON objects, text or binary WebSocket frames, at most
``MAX_FRAME_BYTES``)::

    {"type": "chat", "content": "...", "session_id": "...", "system": "...",
     "resumable": true, "params": {"max_tokens": 256, "temperature": 0.7, "top_p": 1.0,
                                   "top_k": null, "seed": null, "stop": [], "n": 1}}
    {"type": "cancel"}
    {"type": "reset"}

Every key but ``type`` (and ``content`` for chat) is optional; unknown keys
are refused so that a typo never silently changes meaning. Params default to
the values shown (``max_tokens: null`` means "up to max_model_len",
``top_k: null`` keeps every token; ``top_k: -1`` is accepted as the same);
``stop_token_ids``, ``ignore_eos`` and ``min_tokens`` are accepted too, and
``beam_width`` (with ``length_penalty`` and ``early_stopping``) runs beam
search: the ``n`` best hypotheses arrive as one delta each at the end. Each
param's type and range is the OpenAI API's
(:class:`streamkv.server.openai.protocol.SamplingFields`), defined once.

Server frames are built by the ``*_frame`` helpers below; the README documents
both directions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import ConfigDict, ValidationError

from streamkv.errors import EngineError, ErrorCode
from streamkv.outputs import FinishReason, Usage
from streamkv.sampling_params import SamplingParams
from streamkv.server.openai.errors import from_validation
from streamkv.server.openai.protocol import SamplingFields

MAX_FRAME_BYTES = 1 << 20
# The transport refuses (closes with 1009) only far beyond our own cap, so a
# too-large frame gets a ``frame_too_large`` error and the socket lives on.
WS_MAX_SIZE = 4 * MAX_FRAME_BYTES

# Error messages may quote what the client sent (a session id, a frame type):
# never echo more than this many characters of it back.
MAX_ERROR_MESSAGE_CHARS = 300

DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 0.7


class FrameError(EngineError):
    """A client frame the server refuses; ``code`` is stable (see module docstring)."""


@dataclass(frozen=True, slots=True)
class ChatFrame:
    content: str
    params: SamplingParams
    session_id: str | None = None
    system: str | None = None
    resumable: bool | None = None  # None: leave the session's flag as it is


@dataclass(frozen=True, slots=True)
class CancelFrame:
    pass


@dataclass(frozen=True, slots=True)
class ResetFrame:
    pass


ClientFrame = ChatFrame | CancelFrame | ResetFrame

_CHAT_KEYS = frozenset({"type", "content", "session_id", "system", "resumable", "params"})


def parse_frame(data: str | bytes) -> ClientFrame:
    """Parse one client frame.

    Raises:
        FrameError: ``frame_too_large``, ``invalid_json``, ``unknown_type`` or
            ``invalid_params`` (the message names the field).
    """
    size = len(data)
    if isinstance(data, str) and MAX_FRAME_BYTES // 4 < size <= MAX_FRAME_BYTES:
        size = len(data.encode("utf-8", "surrogatepass"))  # chars <= bytes <= 4 * chars
    if size > MAX_FRAME_BYTES:
        raise FrameError(ErrorCode.FRAME_TOO_LARGE, f"frame exceeds the limit of {MAX_FRAME_BYTES} bytes")
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise FrameError(ErrorCode.INVALID_JSON, f"frame is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise FrameError(ErrorCode.INVALID_JSON, f"frame must be a JSON object, not {_json_type(obj)}")
    kind = obj.get("type")
    if kind == "chat":
        return _parse_chat(obj)
    if kind in ("cancel", "reset"):
        extra = sorted(set(obj) - {"type"})
        if extra:
            raise FrameError(ErrorCode.INVALID_PARAMS, f"{extra[0]}: unknown field for a {kind} frame")
        return CancelFrame() if kind == "cancel" else ResetFrame()
    if "type" not in obj:
        raise FrameError(ErrorCode.UNKNOWN_TYPE, "frame has no 'type' (expected chat, cancel or reset)")
    raise FrameError(ErrorCode.UNKNOWN_TYPE, f"unknown frame type {kind!r} (expected chat, cancel or reset)")


def _parse_chat(obj: dict[str, Any]) -> ChatFrame:
    extra = sorted(set(obj) - _CHAT_KEYS)
    if extra:
        raise FrameError(ErrorCode.INVALID_PARAMS, f"{extra[0]}: unknown field for a chat frame")
    content = obj.get("content")
    if not isinstance(content, str):
        raise FrameError(ErrorCode.INVALID_PARAMS, f"content: must be a string, not {_json_type(content)}")
    if not content.strip():
        raise FrameError(ErrorCode.INVALID_PARAMS, "content: must not be empty")
    session_id = _optional_str(obj, "session_id")
    if session_id == "":
        raise FrameError(ErrorCode.INVALID_PARAMS, "session_id: must not be empty (omit it to start a session)")
    system = _optional_str(obj, "system")
    resumable = obj.get("resumable")
    if resumable is not None and not isinstance(resumable, bool):
        raise FrameError(ErrorCode.INVALID_PARAMS, f"resumable: must be true or false, not {_json_type(resumable)}")
    raw_params = obj.get("params")
    if raw_params is None:
        raw_params = {}
    if not isinstance(raw_params, dict):
        raise FrameError(ErrorCode.INVALID_PARAMS, f"params: must be an object, not {_json_type(raw_params)}")
    return ChatFrame(
        content=content, params=parse_params(raw_params), session_id=session_id, system=system, resumable=resumable
    )


class _FrameParams(SamplingFields):
    """``/ws/chat`` params: the API's sampling fields, but an unknown key is refused (a typo never passes)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def parse_params(raw: dict[str, Any]) -> SamplingParams:
    """Validate ``raw`` with the OpenAI API's sampling fields and build SamplingParams.

    ``max_tokens`` absent is ``DEFAULT_MAX_TOKENS``, ``null`` is "up to
    max_model_len"; ``temperature`` absent or ``null`` is ``DEFAULT_TEMPERATURE``.

    Raises:
        FrameError: ``invalid_params``, the message naming the field (``params.max_tokens: ...``).
    """
    try:
        fields = _FrameParams.model_validate(raw)
    except ValidationError as e:
        raise FrameError(ErrorCode.INVALID_PARAMS, f"params.{from_validation(e).message}") from None
    unbounded = "max_tokens" in raw and raw["max_tokens"] is None
    try:
        return fields.sampling_params(
            default_max_tokens=None if unbounded else DEFAULT_MAX_TOKENS, default_temperature=DEFAULT_TEMPERATURE
        )
    except ValueError as e:  # SamplingParams names the field; prefix the frame path
        raise FrameError(ErrorCode.INVALID_PARAMS, f"params.{e}") from None


def _optional_str(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise FrameError(ErrorCode.INVALID_PARAMS, f"{key}: must be a string, not {_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


# ------------------------------------------------------------ server frames


def session_frame(session_id: str, *, resumed: bool, num_turns: int = 0, num_tokens: int = 0) -> dict[str, Any]:
    """``num_turns`` and ``num_tokens``: what the session's history holds (0 for a new session)."""
    return {
        "type": "session",
        "session_id": session_id,
        "resumed": resumed,
        "num_turns": num_turns,
        "num_tokens": num_tokens,
    }


def delta_frame(index: int, text: str, token_ids: list[int]) -> dict[str, Any]:
    return {"type": "delta", "index": index, "text": text, "token_ids": list(token_ids)}


def done_frame(
    finish_reasons: list[FinishReason], usage: Usage, ttft_s: float | None, total_s: float
) -> dict[str, Any]:
    """One ``done`` per turn; ``finish_reason`` is sample 0's, ``finish_reasons[i]`` sample i's."""
    return {
        "type": "done",
        "finish_reason": finish_reasons[0],
        "finish_reasons": finish_reasons,
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.cached_tokens,
            "completion_tokens": usage.completion_tokens,
        },
        "timings": {
            "ttft_ms": None if ttft_s is None else round(ttft_s * 1000.0, 3),
            "total_ms": round(total_s * 1000.0, 3),
        },
    }


def error_frame(code: ErrorCode, message: str) -> dict[str, Any]:
    """An ``error`` frame; ``message`` is cut to ``MAX_ERROR_MESSAGE_CHARS`` (it may quote client input)."""
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        message = message[: MAX_ERROR_MESSAGE_CHARS - 1] + "\u2026"
    return {"type": "error", "code": code, "message": message}


def reset_frame() -> dict[str, Any]:
    return {"type": "reset"}
