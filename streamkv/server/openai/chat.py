"""``POST /v1/chat/completions``: messages through the model's chat template, streamed (SSE) or not.

The prompt is built by the same :class:`~streamkv.model.chat.ChatFormatter`
that ``/ws/chat`` uses (a ``[system?, user]`` conversation gives the ids of
a ``/ws/chat`` first turn). ``max_completion_tokens`` (or the older
``max_tokens``) defaults to "up to max_model_len"; ``temperature`` to 1.

Streaming sends ``chat.completion.chunk`` events: per choice first a delta
with ``role`` (and empty content), then content deltas, the last one with
``finish_reason``; with ``stream_options.include_usage`` a final chunk with
no choices carries the usage; then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from streamkv.errors import EngineError
from streamkv.server.openai.errors import APIError, from_engine, from_params, invalid
from streamkv.server.openai.generation import (
    Admitted,
    ClientGone,
    admit,
    collect,
    finish_reason,
    merged,
    unless_disconnected,
    usage_body,
)
from streamkv.server.openai.protocol import ChatCompletionRequest
from streamkv.server.openai.serving import OpenAIServing
from streamkv.server.openai.sse import DONE, SSEResponse, sse_event

DEFAULT_TEMPERATURE = 1.0


async def conversation_ids(serving: OpenAIServing, req_messages: list[Any]) -> list[int]:
    """Prompt ids of ``messages`` under the chat template (off the event loop); 400 if the template refuses."""
    messages = [m.as_template_message() for m in req_messages]
    try:
        return await asyncio.to_thread(serving.engine.chat.conversation, messages)
    except Exception as e:  # noqa: BLE001 - a template that raises (e.g. on a role order it does not allow)
        raise APIError(400, f"messages: the chat template refused them: {e}", "invalid_value", "messages") from None


def chat_endpoint(serving: OpenAIServing) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            req = await serving.parse(request, ChatCompletionRequest)
            serving.check_engine()
            if req.top_logprobs is not None and not req.logprobs:
                raise invalid("top_logprobs", "needs logprobs set to true")
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            fields = req.model_copy(update={"max_tokens": req.effective_max_tokens})
            try:
                params = fields.sampling_params(
                    default_max_tokens=None, default_temperature=DEFAULT_TEMPERATURE, logprobs=logprobs
                )
            except ValueError as e:
                raise from_params(e) from None
            serving.check_stop(params.stop)
            ids = await conversation_ids(serving, req.messages)
            serving.check_context_length(len(ids), params.max_tokens, "messages")
            runs = await admit(serving.engine, [ids], params)
        except APIError as e:
            return e.response()
        except EngineError as e:
            return from_engine(e).response()
        if req.stream:
            return SSEResponse(_stream(serving, runs[0], params.n, req.include_usage, logprobs is not None))
        try:
            (result,) = await unless_disconnected(request, collect(runs, params.n))
        except ClientGone:
            return Response(status_code=499)
        except EngineError as e:
            return from_engine(e).response()
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": serving.logprobs.chat(c.logprobs) if logprobs is not None else None,
                "finish_reason": finish_reason(c.finish_reason),
            }
            for i, c in enumerate(result.choices)
        ]
        body = {**serving.envelope("chatcmpl", "chat.completion"), "choices": choices,
                "usage": usage_body([result.usage])}  # fmt: skip
        return Response(orjson.dumps(body), media_type="application/json")

    return endpoint


async def _stream(
    serving: OpenAIServing, run: Admitted, n: int, include_usage: bool, want_logprobs: bool
) -> AsyncIterator[bytes]:
    env = serving.envelope("chatcmpl", "chat.completion.chunk")
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    usage = None

    def chunk(index: int, delta: dict[str, Any], lp: dict[str, Any] | None, reason: str | None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return sse_event({**env, "choices": [choice], **extra})

    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""}, None, None)
        try:
            async for _, out in merged([run]):
                for d in out.deltas:
                    if not (d.text or d.finish_reason or d.logprobs):
                        continue
                    lp = serving.logprobs.chat(d.logprobs or []) if want_logprobs else None
                    yield chunk(d.index, {"content": d.text} if d.text else {}, lp, finish_reason(d.finish_reason))
                if out.usage is not None:
                    usage = out.usage
        except EngineError as e:  # the engine failed mid-stream: the status is sent already
            yield sse_event({"error": from_engine(e).body()})
            yield DONE
            return
        if include_usage:
            yield sse_event({**env, "choices": [], "usage": usage_body([usage])})
        yield DONE
    finally:
        await run.aclose()
