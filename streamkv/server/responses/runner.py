"""One response: resolve ``previous_response_id``, build the prompt ids, run the turn on its chain.

What ``previous_response_id`` names decides the chain (a chain is a
:class:`~streamkv.server.sessions.Session`)::

    the newest response of an idle chain  -> that chain: its pin is adopted, only new tokens computed
    an older response, or a chain mid-turn -> a fork: a new chain from that response's token ids;
                                              its full blocks come from the prefix cache (shared, COW)
    unknown, expired, another socket's     -> previous_response_not_found
    none                                   -> a new chain

A chained turn's prompt is the named response's token ids plus the template
fragment of the new user turn (:func:`~streamkv.server.sessions.chained_prompt`):
history is never re-tokenized. An incomplete response (cut by
``max_output_tokens``) or a cancelled one continues from exactly the tokens
it holds. A response whose client went away mid-answer is not stored and
does not enter its chain.

A ``store: true`` response in flight can be cancelled by id
(:meth:`ResponseRunner.cancel`, ``POST /v1/responses/{id}/cancel``): it
stops after the last output its stream has sent, ends with status
``cancelled``, and is stored holding exactly the tokens it sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from streamkv.errors import EngineError, ErrorCode
from streamkv.metrics import EngineMetrics
from streamkv.outputs import FinishReason, RequestOutput, Usage
from streamkv.server.openai.errors import APIError, from_engine, from_params, invalid
from streamkv.server.openai.generation import Admitted, admit
from streamkv.server.openai.serving import OpenAIServing
from streamkv.server.responses.objects import Event, ResponseDraft
from streamkv.server.responses.protocol import ResponseCreate
from streamkv.server.responses.store import ResponseStore, StoredResponse
from streamkv.server.sessions import Session, SessionRegistry, SessionState, chained_prompt


@dataclass(slots=True)
class TurnPlan:
    """A response ready to run: its prompt and the chain it runs on (acquired: GENERATING)."""

    prompt_ids: list[int]
    chain: Session
    forked: bool


@dataclass(slots=True)
class InFlight:
    """A ``store: true`` response while it runs: what :meth:`ResponseRunner.cancel` needs."""

    draft: ResponseDraft
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set once it is stored, or dropped


class ResponseRunner:
    """Runs responses for the HTTP routes and the WebSocket mode alike.

    Args:
        serving: the OpenAI routes' shared state (engine, model id, checks).
        sessions: the chain registry.
        store: the server-wide store (``store: true``).
        metrics: counts stored responses, forks and ``previous_response_not_found``.
    """

    def __init__(
        self, serving: OpenAIServing, sessions: SessionRegistry, store: ResponseStore, metrics: EngineMetrics
    ) -> None:
        self.serving = serving
        self.sessions = sessions
        self.store = store
        self.metrics = metrics
        self._in_flight: dict[str, InFlight] = {}

    def find(self, response_id: str, local: ResponseStore | None = None) -> StoredResponse | None:
        """A finished response by id: this socket's own (``store: false``) first, then the server's."""
        found = local.get(response_id) if local is not None else None
        return found if found is not None else self.store.get(response_id)

    async def plan(self, req: ResponseCreate, local: ResponseStore | None = None) -> TurnPlan:
        """Validate ``req``, build its prompt ids and acquire its chain.

        Raises:
            APIError: ``previous_response_not_found``, ``invalid_value``,
                ``context_length_exceeded``, ``model_not_found``,
                ``engine_stopped``, ``too_many_sessions``.
        """
        serving = self.serving
        serving.check_model(req.model)
        serving.check_engine()
        try:
            params = req.sampling_params()
        except ValueError as e:
            raise from_params(e) from None
        engine = serving.engine
        messages = req.messages()
        previous: StoredResponse | None = None
        if req.previous_response_id is not None:
            previous = self.find(req.previous_response_id, local)
            if previous is None:
                self.metrics.previous_response_not_found.inc()
                raise _not_found(req.previous_response_id)
            if req.instructions is not None and req.instructions != previous.chain.system:
                raise invalid(
                    "instructions",
                    "a chain keeps the instructions of its first response; start a new chain to change them",
                )
            history = previous.token_ids
            if len(messages) == 1 and messages[0].role == "user":  # the ids /ws/chat builds for a turn
                user = messages[0].text
                ids = await asyncio.to_thread(chained_prompt, engine.chat, engine.eos_token_ids, history, user)
            else:
                ended = history[-1] in engine.eos_token_ids
                turns = [{"role": m.template_role, "content": m.text} for m in messages]
                try:
                    ids = history + await asyncio.to_thread(engine.chat.next_messages, turns, ended)
                except Exception as e:  # noqa: BLE001 - a template that refuses a role order
                    raise APIError(400, f"input: the chat template refused it: {e}", "invalid_value", "input") from None
        elif len(messages) == 1 and messages[0].role == "user":
            user, system = messages[0].text, req.instructions
            ids = await asyncio.to_thread(chained_prompt, engine.chat, engine.eos_token_ids, [], user, system)
        else:
            turns = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else []) + [
                {"role": m.template_role, "content": m.text} for m in messages
            ]
            try:
                ids = await asyncio.to_thread(engine.chat.conversation, turns)
            except Exception as e:  # noqa: BLE001 - a template that refuses a role order
                raise APIError(400, f"input: the chat template refused it: {e}", "invalid_value", "input") from None
        serving.check_context_length(len(ids), params.max_tokens, "input")
        try:
            if previous is not None and previous.is_head and self.sessions.acquire(previous.chain):
                return TurnPlan(ids, previous.chain, forked=False)
            chain = self.sessions.create()
        except EngineError as e:
            raise from_engine(e) from None
        chain.system = previous.chain.system if previous is not None else req.instructions
        self.sessions.acquire(chain)
        if previous is not None:
            self.metrics.chains_forked.inc()
        return TurnPlan(ids, chain, forked=previous is not None)

    async def run(
        self,
        req: ResponseCreate,
        plan: TurnPlan,
        draft: ResponseDraft,
        emit: Callable[[Event], None],
        *,
        local: ResponseStore | None = None,
    ) -> StoredResponse:
        """Generate the response, emitting its events; store it and advance its chain.

        ``local``: the socket's own store (``store: false`` responses go there,
        and their chain stays attached to the socket; without one they are not
        kept at all). Cancelled (the client went away): nothing is stored, the
        chain is as it was, and ``CancelledError`` propagates.

        Raises:
            APIError: the engine refused the prompt (before any event was emitted).
        """
        chain = plan.chain
        params = req.sampling_params()
        flight = InFlight(draft)
        if req.store:  # only a stored response can be named by another request
            self._in_flight[draft.response_id] = flight
        try:
            try:
                (run,) = await admit(self.serving.engine, [plan.prompt_ids], params, chain.session_id)
            except EngineError as e:
                raise from_engine(e) from None
            output_ids: list[int] = []
            reason: FinishReason | None = None
            usage: Usage | None = None
            cached = 0
            for event in draft.opening():
                emit(event)
            outputs = _until(run, flight.cancel)
            try:
                async for out in outputs:
                    cached = out.num_cached_tokens or cached
                    for d in out.deltas:
                        if d.index != 0:
                            continue
                        output_ids.extend(d.token_ids)
                        if d.text:
                            emit(draft.delta(d.text))
                        if d.finish_reason is not None:
                            reason = d.finish_reason
                    if out.usage is not None:
                        usage = out.usage
            except EngineError as e:
                raise from_engine(e) from None
            finally:
                await outputs.aclose()
                await run.aclose()
            if reason is None and flight.cancel.is_set():
                reason = FinishReason.CANCELLED  # cut after the last output sent: it holds exactly those tokens
            usage = usage or Usage(len(plan.prompt_ids), cached, len(output_ids))
            for event in draft.closing(reason or FinishReason.STOP, usage):
                emit(event)
            stored = StoredResponse(draft.response_id, plan.prompt_ids + output_ids, chain, draft.response())
            target = self.store if req.store else local
            if target is None:
                return stored  # nothing can name it (store: false over HTTP): the chain stays as it was
            chain.history = stored.token_ids
            chain.head = draft.response_id
            chain.resumable = req.store
            chain.num_turns += 1
            target.put(stored)
            self.metrics.responses_stored.inc()
            return stored
        finally:
            self._settle(chain, keep_attached=local is not None)
            self._in_flight.pop(draft.response_id, None)
            flight.done.set()

    async def cancel(self, response_id: str) -> dict[str, object]:
        """Cancel a ``store: true`` response in flight; returns its ``Response`` object once it is stored.

        A cancelled response ends after the last output its stream sent,
        with status ``cancelled`` (one that finished meanwhile keeps its own
        status), and is stored: ``previous_response_id`` continues from
        exactly its tokens. Cancelling a cancelled response returns it
        unchanged. OpenAI cancels only ``background`` responses and refuses
        the others; streamkv has no background mode, so it cancels what is
        still generating and refuses what is finished.

        Raises:
            APIError: 404 ``response_not_found`` (unknown, expired, or
                another connection's ``store: false``); 400 ``invalid_value``
                for a response that finished on its own (completed or
                incomplete).
        """
        flight = self._in_flight.get(response_id)
        if flight is not None:
            flight.cancel.set()
            await flight.done.wait()
            entry = self.store.get(response_id)
            if entry is None:  # abandoned meanwhile (its client went away): never stored
                raise unknown_response(response_id)
            return entry.body
        entry = self.store.get(response_id)
        if entry is None:
            raise unknown_response(response_id)
        if entry.body["status"] == "cancelled":
            return entry.body
        raise APIError(
            400,
            f"Cannot cancel a response that is not in progress (its status is {entry.body['status']}); "
            "only a response still generating can be cancelled",
            "invalid_value",
            "response_id",
        )

    def abandon(self, plan: TurnPlan, *, local: ResponseStore | None = None) -> None:
        """After the task that was to :meth:`run` ``plan`` is done: settle the chain if it never ran."""
        if plan.chain.state is SessionState.GENERATING:
            self._settle(plan.chain, keep_attached=local is not None)

    def _settle(self, chain: Session, *, keep_attached: bool) -> None:
        """The turn is over: park the chain under the TTL, leave it to the socket, or release it."""
        if chain.head is None:
            self.sessions.end_turn(chain)
            self.sessions.release(chain)
        elif chain.resumable:
            self.sessions.park(chain, keep=True)
        elif keep_attached:
            self.sessions.end_turn(chain)
        else:
            self.sessions.end_turn(chain)
            self.sessions.release(chain)


async def _until(run: Admitted, cancel: asyncio.Event) -> AsyncGenerator[RequestOutput, None]:
    """``run``'s outputs until it ends or ``cancel`` is set; close it, then ``run.aclose()`` aborts the rest.

    An output already received is yielded before a cancel is noticed, so the
    caller holds exactly the outputs yielded.
    """
    outputs = run.__aiter__()
    stop = asyncio.ensure_future(cancel.wait())
    nxt: asyncio.Future[RequestOutput] | None = None
    try:
        while not cancel.is_set():
            nxt = asyncio.ensure_future(outputs.__anext__())
            await asyncio.wait((nxt, stop), return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                return  # cancelled while the request waits in the engine
            try:
                out = nxt.result()
            except StopAsyncIteration:
                return
            nxt = None
            yield out
    finally:
        stop.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)


def unknown_response(response_id: str) -> APIError:
    """404 ``response_not_found`` (``GET``, ``DELETE``, ``cancel`` of an unknown or expired id)."""
    shown = response_id if len(response_id) <= 64 else response_id[:64] + "..."
    err = EngineError(ErrorCode.RESPONSE_NOT_FOUND, f"No response with id '{shown}' is stored (unknown or expired).")
    return APIError(404, err.message, err.code, "response_id")


def _not_found(response_id: str) -> APIError:
    shown = response_id if len(response_id) <= 64 else response_id[:64] + "..."
    err = EngineError(
        ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND,
        f"Previous response with id '{shown}' not found (unknown, expired, deleted, or stored on another "
        "connection with store: false).",
    )
    return APIError(400, err.message, err.code, "previous_response_id")
