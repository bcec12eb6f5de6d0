"""Engine requests behind one HTTP request: admitted up front, merged, cut off on disconnect.

An OpenAI request may carry several prompts (``/v1/completions``); each is
one engine request. All of them are admitted before any byte of the response
is sent, so a refusal (context length, pool size, engine down) is an HTTP
status, not an error in the middle of a stream. However the HTTP request
ends, :meth:`Admitted.aclose` closes each engine generator, and
``AsyncEngine.generate``'s ``finally`` aborts what is still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request

from streamkv.outputs import RequestOutput, TokenLogprob, Usage
from streamkv.sampling_params import SamplingParams
from streamkv.server.engine_api import ServingEngine

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


class Admitted:
    """One admitted engine request: its first output is on its way."""

    def __init__(self, first: asyncio.Task[RequestOutput], outputs: AsyncIterator[RequestOutput]) -> None:
        self._first = first
        self._outputs = outputs

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        out = await self._first
        yield out
        if not out.finished:
            async for out in self._outputs:
                yield out

    async def aclose(self) -> None:
        """Stop the request (a no-op once it has finished)."""
        if not self._first.done():
            self._first.cancel()
        await asyncio.gather(self._first, return_exceptions=True)
        aclose = getattr(self._outputs, "aclose", None)
        if aclose is not None:
            await aclose()


async def admit(
    engine: ServingEngine, prompts: list[list[int]], params: SamplingParams, session_id: str | None = None
) -> list[Admitted]:
    """Start one engine request per prompt; all admitted, or none left running.

    ``session_id``: the chain whose pin the (single) prompt continues, and which pins it afterwards.

    Raises:
        EngineError: the engine refused a prompt (the others are aborted).
    """
    admitted: list[Admitted] = []
    try:
        for ids in prompts:
            outputs = engine.generate(ids, params, session_id=session_id)
            first = asyncio.ensure_future(_first_output(outputs))
            # One loop turn runs generate() up to its first wait: admission has happened by then.
            await asyncio.sleep(0)
            if first.done() and first.exception() is not None:
                raise first.exception()  # type: ignore[misc]
            admitted.append(Admitted(first, outputs))
    except BaseException:
        for run in admitted:
            await run.aclose()
        raise
    return admitted


async def _first_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await outputs.__anext__()


async def merged(runs: list[Admitted]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position."""
    if len(runs) == 1:
        try:
            async for out in runs[0]:
                yield 0, out
        finally:
            await runs[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, run: Admitted) -> None:
        try:
            async for out in run:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(runs)]
    try:
        remaining = len(runs)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for run in runs:
            await run.aclose()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise :class:`ClientGone`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass(slots=True)
class Choice:
    """One sample's output so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(slots=True)
class Collected:
    """Everything one engine request returned."""

    choices: list[Choice]
    usage: Usage | None = None


async def collect(runs: list[Admitted], n: int) -> list[Collected]:
    """Run every request to its end (non-streaming responses)."""
    results = [Collected([Choice() for _ in range(n)]) for _ in runs]
    try:
        async for i, out in merged(runs):
            for d in out.deltas:
                c = results[i].choices[d.index]
                c.text += d.text
                c.token_ids.extend(d.token_ids)
                if d.logprobs:
                    c.logprobs.extend(d.logprobs)
                if d.finish_reason is not None:
                    c.finish_reason = d.finish_reason
            if out.usage is not None:
                results[i].usage = out.usage
    finally:
        for run in runs:
            await run.aclose()
    return results


def finish_reason(engine_reason: str | None) -> str | None:
    """OpenAI's vocabulary: ``stop``, ``length``; a request aborted by the server is ``abort`` (vLLM's)."""
    if engine_reason is None:
        return None
    reason = str(engine_reason)
    return "abort" if reason == "cancelled" else reason


def usage_body(usages: list[Usage | None]) -> dict[str, object]:
    """OpenAI's usage object, summed over prompts; ``prompt_tokens_details.cached_tokens`` always present."""
    prompt = sum(u.prompt_tokens for u in usages if u is not None)
    cached = sum(u.cached_tokens for u in usages if u is not None)
    completion = sum(u.completion_tokens for u in usages if u is not None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
