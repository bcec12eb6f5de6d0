"""Errors that reach clients, each with a stable code."""

from __future__ import annotations


class EngineError(Exception):
    """A request the engine refuses; ``code`` is stable, ``message`` is for people.

    Codes: ``prompt_too_long`` (prompt + max_tokens over max_model_len),
    ``exceeds_pool`` (could never fit the KV pool), ``empty_prompt``,
    ``invalid_params``, ``engine_stopped``, ``session_busy`` (a session has a
    turn in flight), ``unknown_session``.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
