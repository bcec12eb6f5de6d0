"""``POST /v1/responses`` (streamed as SSE or not), ``GET`` and ``DELETE /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``.

Streaming sends each event as ``event: <type>`` + ``data: {json}``; an
engine failure mid-stream ends it with an ``error`` event. Over HTTP,
``store: false`` keeps nothing (there is no connection to keep it on).
A client that disconnects mid-response leaves no trace in its chain.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from streamkv.server.openai.errors import APIError
from streamkv.server.openai.generation import ClientGone, unless_disconnected
from streamkv.server.openai.sse import SSEResponse
from streamkv.server.responses.objects import Event, ResponseDraft
from streamkv.server.responses.protocol import ResponseCreate
from streamkv.server.responses.runner import ResponseRunner, TurnPlan, unknown_response


def sse(event: Event) -> bytes:
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def create_endpoint(runner: ResponseRunner) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            req = await runner.serving.parse(request, ResponseCreate)
            plan = await runner.plan(req)
        except APIError as e:
            return e.response()
        draft = ResponseDraft(req, runner.serving.model_id)
        if req.stream:
            return SSEResponse(_EventStream(runner, req, plan, draft))
        try:
            await unless_disconnected(request, runner.run(req, plan, draft, lambda _event: None))
        except ClientGone:
            return Response(status_code=499)
        except APIError as e:
            return e.response()
        finally:
            runner.abandon(plan)
        return Response(orjson.dumps(draft.response()), media_type="application/json")

    return endpoint


class _EventStream:
    """The SSE body: runs the response in a task; ``aclose`` (always called) abandons it if unfinished."""

    def __init__(self, runner: ResponseRunner, req: ResponseCreate, plan: TurnPlan, draft: ResponseDraft) -> None:
        self._runner = runner
        self._plan = plan
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._task = asyncio.ensure_future(runner.run(req, plan, draft, self._queue.put_nowait))
        self._task.add_done_callback(lambda _t: self._queue.put_nowait(None))
        self._ended = False

    def __aiter__(self) -> _EventStream:
        return self

    async def __anext__(self) -> bytes:
        if self._ended:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event is not None:
            return sse(event)
        self._ended = True
        error = None if self._task.cancelled() else self._task.exception()
        if isinstance(error, APIError):
            return sse({"type": "error", "sequence_number": None, **error.body()})
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if not self._task.done():
            self._task.cancel()  # the client went away: the response is abandoned
        await asyncio.gather(self._task, return_exceptions=True)
        self._runner.abandon(self._plan)


def item_endpoint(runner: ResponseRunner) -> Callable[[Request], Awaitable[Response]]:
    """``GET`` returns a stored response; ``DELETE`` drops it (and its chain's pin, if it is the newest)."""

    async def endpoint(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        entry = runner.store.get(response_id)
        if entry is None:
            return unknown_response(response_id).response()
        if request.method == "DELETE":
            runner.store.delete(response_id)
            body: dict[str, Any] = {"id": response_id, "object": "response.deleted", "deleted": True}
            return Response(orjson.dumps(body), media_type="application/json")
        return Response(orjson.dumps(entry.body), media_type="application/json")

    return endpoint


def cancel_endpoint(runner: ResponseRunner) -> Callable[[Request], Awaitable[Response]]:
    """``POST /v1/responses/{id}/cancel``: stop a response in flight; its ``Response`` object, status ``cancelled``.

    See :meth:`ResponseRunner.cancel` (404 for an unknown id, 400 for a finished one).
    """

    async def endpoint(request: Request) -> Response:
        try:
            body = await runner.cancel(request.path_params["response_id"])
        except APIError as e:
            return e.response()
        return Response(orjson.dumps(body), media_type="application/json")

    return endpoint
