"""Errors that reach clients, each with a stable code from :class:`ErrorCode`."""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Every ``code`` the server can send in an error frame (the README's error table lists the same set).

    Members compare equal to their string values (``ErrorCode.SESSION_BUSY == "session_busy"``).
    """

    INVALID_JSON = "invalid_json"  # the frame is not a JSON object
    UNKNOWN_TYPE = "unknown_type"  # no or unknown frame ``type``
    INVALID_PARAMS = "invalid_params"  # a field of the wrong type or range
    FRAME_TOO_LARGE = "frame_too_large"  # over protocol.MAX_FRAME_BYTES
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt + max_tokens over max_model_len
    EXCEEDS_POOL = "exceeds_pool"  # could never fit the KV pool
    EMPTY_PROMPT = "empty_prompt"  # a prompt of no tokens (offline API)
    UNKNOWN_SESSION = "unknown_session"  # resume of an unknown or expired session id
    SESSION_LOST = "session_lost"  # under Ray Serve: this replica does not hold the session (its replica died)
    SESSION_BUSY = "session_busy"  # the session has a turn in flight or another socket
    TOO_MANY_SESSIONS = "too_many_sessions"  # at max_sessions, and every session is attached to a socket
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"  # Responses: unknown, expired or another connection's
    RESPONSE_NOT_FOUND = "response_not_found"  # GET / DELETE /v1/responses/{id} of an unknown or expired id
    ENGINE_STOPPED = "engine_stopped"  # the engine thread is not running
    ENGINE_ERROR = "engine_error"  # the engine thread failed; every request in flight gets it
    INTERNAL_ERROR = "internal_error"  # a bug in the server's handling of a frame


class EngineError(Exception):
    """A request the engine or server refuses; ``code`` is stable, ``message`` is for people.

    Args:
        code: one of :class:`ErrorCode` (a plain string of a member's value is converted).
        message: a human-readable explanation naming the offending field or limit.

    Raises:
        ValueError: ``code`` is not an :class:`ErrorCode` value.
    """

    def __init__(self, code: ErrorCode | str, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
