"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes.

``/tokenize`` takes ``{"prompt": str}`` (``add_special_tokens`` default true)
or ``{"messages": [...]}`` (rendered through the chat template with the
generation prompt, exactly as ``/v1/chat/completions`` builds its prompt) and
answers ``{"tokens", "count", "max_model_len"}`` (+ ``token_strs`` when
``return_token_strs``). ``/detokenize`` takes ``{"tokens": [ids]}`` and
answers ``{"prompt": text}``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response

from streamkv.server.openai.chat import conversation_ids
from streamkv.server.openai.errors import APIError
from streamkv.server.openai.protocol import DetokenizeRequest, TokenizeRequest
from streamkv.server.openai.serving import OpenAIServing


def tokenize_endpoint(serving: OpenAIServing) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            req = await serving.parse(request, TokenizeRequest)
            if (req.prompt is None) == (req.messages is None):
                raise APIError(400, "give exactly one of prompt and messages", "invalid_value", "prompt")
            if req.messages is not None:
                ids = await conversation_ids(serving, req.messages)
            else:
                (ids,) = await serving.encode([req.prompt or ""], add_special_tokens=req.add_special_tokens)
        except APIError as e:
            return e.response()
        body: dict[str, object] = {"count": len(ids), "max_model_len": serving.engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = serving.tokenizer.convert_ids_to_tokens(ids)
        return Response(orjson.dumps(body), media_type="application/json")

    return endpoint


def detokenize_endpoint(serving: OpenAIServing) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            req = await serving.parse(request, DetokenizeRequest)
            serving.check_token_ids(req.tokens, "tokens")
            text = await serving.decode(req.tokens)
        except APIError as e:
            return e.response()
        return Response(orjson.dumps({"prompt": text}), media_type="application/json")

    return endpoint
