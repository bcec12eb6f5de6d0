"""``POST /v1/chat/completions``: messages through the model's chat template, streamed (SSE) or not.

The prompt is built by the same :class:`~streamkv.model.chat.ChatFormatter`
that ``/ws/chat`` uses (a ``[system?, user]`` conversation gives the ids of
a ``/ws/chat`` first turn). ``max_completion_tokens`` (or the older
``max_tokens``) defaults to "up to max_model_len"; ``temperature`` to 1.

The header ``x-session-id`` (the one Ray Serve's router hashes) makes the
request a turn of a chain (:class:`~streamkv.server.sessions.Session`) kept
between requests under ``--session-ttl``. When ``messages`` repeats the
chain's transcript plus one user message, the prompt is the chain's exact
ids plus that turn's template fragment (history is not re-tokenized, so the
ids cannot shift at the turn boundary). Otherwise the transcript is
tokenized; ids that extend the chain's adopt its pin, and ids that do not
(an edited history) release it first, so the prefix cache serves what it can
and this turn's blocks become the new pin. A request whose chain has a turn
in flight runs without it.

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
from streamkv.sampling_params import SamplingParams
from streamkv.server.openai.errors import APIError, from_engine, from_params, invalid
from streamkv.server.openai.generation import (
    Admitted,
    ClientGone,
    Collected,
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
from streamkv.server.sessions import Session, SessionRegistry, SessionState, chained_prompt

DEFAULT_TEMPERATURE = 1.0
SESSION_HEADER = "x-session-id"
MAX_SESSION_HEADER_CHARS = 256

# Called with sample 0's token ids and text once a streamed answer has finished.
OnFinished = Callable[[list[int], str], None]


async def conversation_ids(serving: OpenAIServing, req_messages: list[Any]) -> list[int]:
    """Prompt ids of ``messages`` under the chat template (off the event loop); 400 if the template refuses."""
    messages = [m.as_template_message() for m in req_messages]
    try:
        return await asyncio.to_thread(serving.engine.chat.conversation, messages)
    except Exception as e:  # noqa: BLE001 - a template that raises (e.g. on a role order it does not allow)
        raise APIError(400, f"messages: the chat template refused them: {e}", "invalid_value", "messages") from None


def chat_endpoint(
    serving: OpenAIServing, sessions: SessionRegistry | None = None
) -> Callable[[Request], Awaitable[Response]]:
    """The route; with ``sessions``, requests carrying ``x-session-id`` are turns of that chain."""

    async def endpoint(request: Request) -> Response:
        alias = request.headers.get(SESSION_HEADER) if sessions is not None else None
        if alias is not None and sessions is not None:
            return await _chained(request, serving, sessions, alias)
        try:
            req = await serving.parse(request, ChatCompletionRequest)
            serving.check_engine()
            params, logprobs = _params(serving, req)
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
        return _completion(serving, result, logprobs)

    return endpoint


def _params(serving: OpenAIServing, req: ChatCompletionRequest) -> tuple[SamplingParams, int | None]:
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
    return params, logprobs


def _completion(serving: OpenAIServing, result: Collected, logprobs: int | None) -> Response:
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


# ------------------------------------------------------------ x-session-id


async def _chained(request: Request, serving: OpenAIServing, sessions: SessionRegistry, alias: str) -> Response:
    """A chat completion that is a turn of the chain ``alias`` names (see the module docstring)."""
    chain: Session | None = None
    try:
        if not alias or len(alias) > MAX_SESSION_HEADER_CHARS:
            raise invalid(SESSION_HEADER, f"must be 1 to {MAX_SESSION_HEADER_CHARS} characters")
        req = await serving.parse(request, ChatCompletionRequest)
        serving.check_engine()
        params, logprobs = _params(serving, req)
        transcript = [(m["role"], m["content"]) for m in (msg.as_template_message() for msg in req.messages)]
        chain = sessions.by_alias(alias)
        if chain is not None and chain.state is SessionState.GENERATING:
            chain = None  # a turn is in flight on it: this request runs on its own
        elif chain is None or not sessions.acquire(chain):
            chain = sessions.create(resumable=True, alias=alias)  # a new chain, or the old one expired
            sessions.acquire(chain)
        engine = serving.engine
        if chain is not None and chain.history and transcript[:-1] == chain.transcript and transcript[-1][0] == "user":
            history, user = chain.history, transcript[-1][1]
            ids = await asyncio.to_thread(chained_prompt, engine.chat, engine.eos_token_ids, history, user)
        else:
            ids = await conversation_ids(serving, req.messages)
            if chain is not None and chain.history and ids[: len(chain.history)] != chain.history:
                engine.release_session(chain.session_id)  # an edited history: the prefix cache takes over
        serving.check_context_length(len(ids), params.max_tokens, "messages")
        runs = await admit(engine, [ids], params, chain.session_id if chain is not None else None)
    except (APIError, EngineError) as e:
        if chain is not None:
            _end_turn(sessions, chain)
        return (e if isinstance(e, APIError) else from_engine(e)).response()

    def advance(token_ids: list[int], text: str) -> None:
        """The answer reached the client: the chain now holds it."""
        if chain is not None:
            chain.history = ids + token_ids
            chain.transcript = [*transcript, ("assistant", text)]
            chain.num_turns += 1

    def end() -> None:
        if chain is not None:
            _end_turn(sessions, chain)

    if req.stream:
        events = _stream(serving, runs[0], params.n, req.include_usage, logprobs is not None, advance)
        return SSEResponse(_Ending(events, end))
    try:
        (result,) = await unless_disconnected(request, collect(runs, params.n))
        advance(result.choices[0].token_ids, result.choices[0].text)
        return _completion(serving, result, logprobs)
    except ClientGone:
        return Response(status_code=499)
    except EngineError as e:
        return from_engine(e).response()
    finally:
        end()


def _end_turn(sessions: SessionRegistry, chain: Session) -> None:
    """The turn is over (or never ran): keep the chain under the TTL, or drop it while it holds nothing."""
    if chain.state is not SessionState.GENERATING:
        return
    if chain.history:
        sessions.park(chain, keep=True)
    else:
        sessions.end_turn(chain)
        sessions.release(chain)


class _Ending:
    """An SSE body that calls ``on_end`` once however it ends, even if it was never iterated."""

    def __init__(self, events: AsyncIterator[bytes], on_end: Callable[[], None]) -> None:
        self._events = events
        self._on_end: Callable[[], None] | None = on_end

    def __aiter__(self) -> _Ending:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._events.__anext__()
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            await aclose()
        if self._on_end is not None:
            on_end, self._on_end = self._on_end, None
            on_end()


async def _stream(
    serving: OpenAIServing,
    run: Admitted,
    n: int,
    include_usage: bool,
    want_logprobs: bool,
    on_finished: OnFinished | None = None,
) -> AsyncIterator[bytes]:
    env = serving.envelope("chatcmpl", "chat.completion.chunk")
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    usage = None
    ids: list[int] = []
    text: list[str] = []

    def chunk(index: int, delta: dict[str, Any], lp: dict[str, Any] | None, reason: str | None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return sse_event({**env, "choices": [choice], **extra})

    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""}, None, None)
        try:
            async for _, out in merged([run]):
                for d in out.deltas:
                    if d.index == 0:
                        ids.extend(d.token_ids)
                        text.append(d.text)
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
        if on_finished is not None:
            on_finished(ids, "".join(text))
        if include_usage:
            yield sse_event({**env, "choices": [], "usage": usage_body([usage])})
        yield DONE
    finally:
        await run.aclose()
