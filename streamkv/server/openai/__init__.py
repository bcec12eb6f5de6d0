"""The OpenAI-compatible HTTP API on the same AsyncEngine as ``/ws/chat``.

Routes (see the README for curl examples and the error table)::

    GET  /v1/models
    POST /v1/completions
    POST /v1/chat/completions
    POST /tokenize
    POST /detokenize
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from starlette.routing import Route

from streamkv.server.openai.chat import chat_endpoint
from streamkv.server.openai.completions import completions_endpoint
from streamkv.server.openai.models import models_endpoint
from streamkv.server.openai.serving import OpenAIEngine, OpenAIServing
from streamkv.server.openai.tokenize import detokenize_endpoint, tokenize_endpoint
from streamkv.server.sessions import SessionRegistry

__all__ = ["OpenAIServing", "openai_routes"]


def openai_routes(
    engine: OpenAIEngine,
    served_model_name: str | None,
    max_body_bytes: int,
    check_stop: Callable[[Sequence[str]], None] | None = None,
    sessions: SessionRegistry | None = None,
) -> list[Route]:
    """The API's routes; ``check_stop`` bounds stop strings (the server's ``--max-stop-strings`` flags);
    ``sessions`` holds the chains that ``x-session-id`` names on chat completions (``None``: the header is ignored)."""
    serving = OpenAIServing(engine, served_model_name, max_body_bytes, check_stop)
    return [
        Route("/v1/models", models_endpoint(serving), methods=["GET"]),
        Route("/v1/completions", completions_endpoint(serving), methods=["POST"]),
        Route("/v1/chat/completions", chat_endpoint(serving, sessions), methods=["POST"]),
        Route("/tokenize", tokenize_endpoint(serving), methods=["POST"]),
        Route("/detokenize", detokenize_endpoint(serving), methods=["POST"]),
    ]
