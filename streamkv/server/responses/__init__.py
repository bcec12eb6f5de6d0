"""The OpenAI Responses API over HTTP and in its WebSocket mode, on the server's chains.

Routes::

    POST   /v1/responses         create (``stream: true``: SSE events)
    GET    /v1/responses         WebSocket mode (``response.create`` events)
    GET    /v1/responses/{id}    a stored response
    DELETE /v1/responses/{id}    drop it (the newest response of a chain takes the chain's pin with it)
    POST   /v1/responses/{id}/cancel   stop a response in flight (status ``cancelled``)

A response chain is a :class:`~streamkv.server.sessions.Session`, the same
record as a ``/ws/chat`` session; ``docs/responses.md`` has the semantics.
"""

from __future__ import annotations

from starlette.routing import Route, WebSocketRoute

from streamkv.config import ServerConfig
from streamkv.metrics import EngineMetrics
from streamkv.server.openai.serving import OpenAIServing
from streamkv.server.responses.http import cancel_endpoint, create_endpoint, item_endpoint
from streamkv.server.responses.runner import ResponseRunner
from streamkv.server.responses.store import ResponseStore
from streamkv.server.responses.ws import responses_ws_endpoint
from streamkv.server.sessions import SessionRegistry

__all__ = ["ResponseRunner", "ResponseStore", "responses_routes"]


def responses_routes(
    serving: OpenAIServing,
    sessions: SessionRegistry,
    store: ResponseStore,
    metrics: EngineMetrics,
    config: ServerConfig,
) -> list[Route | WebSocketRoute]:
    """The Responses API's routes over ``store`` (server-wide, ``store: true``)."""
    runner = ResponseRunner(serving, sessions, store, metrics)
    return [
        Route("/v1/responses", create_endpoint(runner), methods=["POST"]),
        WebSocketRoute("/v1/responses", responses_ws_endpoint(runner, metrics, config)),
        Route("/v1/responses/{response_id}", item_endpoint(runner), methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/cancel", cancel_endpoint(runner), methods=["POST"]),
    ]
