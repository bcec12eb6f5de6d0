"""``POST /v1/completions``: OpenAI's legacy completions, streamed (SSE) or not.

Each prompt is one engine request with ``n`` samples; choice ``index`` is
``prompt_position * n + sample``, as in vLLM. ``max_tokens`` defaults to 16
and ``temperature`` to 1 (OpenAI's defaults). ``echo`` prepends the prompt's
text; ``logprobs: k`` returns the sampled tokens' logprobs and the ``k``
likeliest alternatives (``echo`` with ``logprobs`` is refused: prompt
logprobs are not computed). ``beam_width`` (with ``length_penalty`` and
``early_stopping``) runs beam search: the choices are the ``n`` best
hypotheses, each sent whole when the search ends (one chunk per choice when
streaming).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from streamkv.errors import EngineError
from streamkv.outputs import Usage
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
from streamkv.server.openai.protocol import CompletionRequest
from streamkv.server.openai.serving import OpenAIServing
from streamkv.server.openai.sse import DONE, SSEResponse, sse_event

DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0


def completions_endpoint(serving: OpenAIServing) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            req = await serving.parse(request, CompletionRequest)
            serving.check_engine()
            if req.echo and req.logprobs is not None:
                raise invalid("echo", "echo together with logprobs is not supported (prompt logprobs are not computed)")
            try:
                params = req.sampling_params(
                    default_max_tokens=DEFAULT_MAX_TOKENS,
                    default_temperature=DEFAULT_TEMPERATURE,
                    logprobs=req.logprobs,
                )
            except ValueError as e:
                raise from_params(e) from None
            serving.check_stop(params.stop)
            prompts = req.prompts()
            encoded = iter(await serving.encode([p for p in prompts if isinstance(p, str)]))
            ids = [next(encoded) if isinstance(p, str) else p for p in prompts]
            for p in ids:
                serving.check_token_ids(p, "prompt")
                serving.check_context_length(len(p), params.max_tokens, "prompt")
            echoes = [p if isinstance(p, str) else await serving.decode(p) for p in prompts] if req.echo else None
            runs = await admit(serving.engine, ids, params)
        except APIError as e:
            return e.response()
        except EngineError as e:
            return from_engine(e).response()
        if req.stream:
            return SSEResponse(_stream(serving, runs, params.n, echoes, req.include_usage, req.logprobs is not None))
        try:
            results = await unless_disconnected(request, collect(runs, params.n))
        except ClientGone:
            return Response(status_code=499)
        except EngineError as e:
            return from_engine(e).response()
        choices = []
        for i, result in enumerate(results):
            for c_index, c in enumerate(result.choices):
                echo = echoes[i] if echoes is not None else ""
                lp = serving.logprobs.completion(c.logprobs, len(echo)) if req.logprobs is not None else None
                choices.append({"index": i * params.n + c_index, "text": echo + c.text, "logprobs": lp,
                                "finish_reason": finish_reason(c.finish_reason)})  # fmt: skip
        body = {**serving.envelope("cmpl", "text_completion"), "choices": choices,
                "usage": usage_body([r.usage for r in results])}  # fmt: skip
        return Response(orjson.dumps(body), media_type="application/json")

    return endpoint


async def _stream(
    serving: OpenAIServing,
    runs: list[Admitted],
    n: int,
    echoes: list[str] | None,
    include_usage: bool,
    want_logprobs: bool,
) -> AsyncIterator[bytes]:
    """One ``text_completion`` chunk per choice delta; usage last when asked; then ``[DONE]``."""
    env = serving.envelope("cmpl", "text_completion")
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    usages: list[Usage | None] = [None] * len(runs)
    offsets = [0] * (len(runs) * n)  # text_offset of each choice's next token

    def chunk(index: int, text: str, lp: dict[str, Any] | None, reason: str | None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
        return sse_event({**env, "choices": [choice], **extra})

    try:
        if echoes is not None:
            for i, text in enumerate(echoes):
                for s in range(n):
                    offsets[i * n + s] = len(text)
                    yield chunk(i * n + s, text, None, None)
        try:
            async for i, out in merged(runs):
                for d in out.deltas:
                    index = i * n + d.index
                    if not (d.text or d.finish_reason or d.logprobs):
                        continue
                    lp = serving.logprobs.completion(d.logprobs or [], offsets[index]) if want_logprobs else None
                    offsets[index] += len(d.text)
                    yield chunk(index, d.text, lp, finish_reason(d.finish_reason))
                if out.usage is not None:
                    usages[i] = out.usage
        except EngineError as e:  # the engine failed mid-stream: the status is sent already
            yield sse_event({"error": from_engine(e).body()})
            yield DONE
            return
        if include_usage:
            yield sse_event({**env, "choices": [], "usage": usage_body(usages)})
        yield DONE
    finally:
        for run in runs:
            await run.aclose()
