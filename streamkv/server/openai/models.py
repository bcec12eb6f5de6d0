"""``GET /v1/models``: the one served model (``vllm bench serve`` reads its ``root``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response

from streamkv.server.openai.serving import OpenAIServing


def model_card(serving: OpenAIServing) -> dict[str, object]:
    """``id`` (``--served-model-name``), ``root`` (the model path or name), ``max_model_len``."""
    return {
        "id": serving.model_id,
        "object": "model",
        "created": serving.created,
        "owned_by": "streamkv",
        "root": serving.root,
        "parent": None,
        "max_model_len": serving.engine.max_model_len,
    }


def models_endpoint(serving: OpenAIServing) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        body = {"object": "list", "data": [model_card(serving)]}
        return Response(orjson.dumps(body), media_type="application/json")

    return endpoint
