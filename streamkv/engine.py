"""The async front of the engine: an engine thread plus per-request asyncio queues.

The event loop never runs model compute. ``generate`` validates, enqueues
an :class:`AddRequest` for the engine thread and awaits that request's
queue; the engine thread hands each :class:`RequestOutput` back with
``loop.call_soon_threadsafe``. Closing the generator early enqueues an
:class:`AbortRequest`, which the engine applies before its next step. The
queue carries only :data:`EngineCommand` records. Starting the engine sets
the process's GIL switch interval to ``SWITCH_INTERVAL_S`` (0.5 ms): the
engine thread wins the GIL back sooner after each torch op. The model is
loaded on a thread that exits afterwards (:func:`run_in_own_thread`), so the
engine thread is the only one that keeps OpenMP workers.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from streamkv.config import EngineConfig
from streamkv.engine_core import EngineCore
from streamkv.errors import EngineError, ErrorCode
from streamkv.metrics_hooks import MetricsHooks
from streamkv.model.chat import ChatFormatter
from streamkv.model.loader import LoadedModel
from streamkv.outputs import RequestOutput, RequestSink
from streamkv.sampling_params import SamplingParams
from streamkv.thread_governor import ThreadGovernor

logger = logging.getLogger(__name__)
T = TypeVar("T")

_IDLE_WAIT_S = 0.05
# The engine thread and the server's event loop share the GIL. The engine thread lets go of it inside
# every torch op of a step (hundreds a step) and must win it back after each; with CPython's default 5 ms
# switch interval it can wait that long behind the event loop (SSE and WebSocket writes, request parsing).
# 0.5 ms: `vllm bench serve` against `streamkv serve --dtype bfloat16`, 128 in / 128 out, two A/B rounds
# (docs/benchmarks.md, "GIL switch interval"): concurrency 8 189 / 187 -> 230 / 238 output tok/s, TPOT 38.7
# / 38.8 -> 31.8 / 30.4 ms; concurrency 1 32.2 / 33.8 -> 36.9 / 37.8 tok/s.
SWITCH_INTERVAL_S = 0.0005


def run_in_own_thread(fn: Callable[[], T], name: str) -> T:
    """``fn()`` on a thread that exits when it returns; its result, or its exception re-raised here.

    Why the engine is built this way: every thread that runs an OpenMP parallel region keeps a team of
    worker threads for the rest of its life, and once libgomp manages more threads than there are CPUs it
    stops spinning between regions and sleeps instead. Loading the model (weight packing, dtype casts)
    runs such regions; done on the main thread, its team outlived the load, and every parallel region of
    the engine thread then paid a futex wake-up: a bf16 decode step at batch 1 on 2 cores took 24.9 ms
    on the engine thread against 12.8 ms on the main thread (docs/benchmarks.md, "Round 15"). A thread
    that exits takes its team with it.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            error.append(e)

    # a daemon: Ctrl-C during a long load ends the process instead of waiting for the load to finish
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a validated request; its outputs (or an :class:`EngineError`) go to ``sink``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: RequestSink
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Cancel a request in flight (no-op when it already finished)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ReleaseSession:
    """Drop a session's pinned blocks."""

    session_id: str


@dataclass(frozen=True, slots=True)
class Wake:
    """Carries nothing: ends the engine thread's idle wait (shutdown)."""


EngineCommand = AddRequest | AbortRequest | ReleaseSession | Wake


class AsyncEngine:
    """Serves many concurrent ``generate`` calls from one engine thread.

    Args:
        config: engine configuration.
        metrics: event observer (Prometheus), optional.
        loaded: an already loaded model (tests), optional.
    """

    def __init__(
        self, config: EngineConfig, metrics: MetricsHooks | None = None, loaded: LoadedModel | None = None
    ) -> None:
        self.config = config
        # built on a thread of its own, so that only the engine thread keeps OpenMP workers (run_in_own_thread)
        self.core = run_in_own_thread(lambda: EngineCore(config, metrics, loaded), "streamkv-load")
        self.tokenizer = self.core.tokenizer
        self.chat = ChatFormatter(self.tokenizer)
        self.max_model_len = self.core.max_model_len
        self.eos_token_ids = tuple(self.core.loaded.eos_token_ids)
        self.model_name = self.core.loaded.name
        self.load_seconds, self.load_source = self.core.loaded.load_seconds, self.core.loaded.source
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        # read here, on the caller's thread: a governor's torch.set_num_threads on the engine thread also sets the
        # count that threads started later begin with, so the engine thread sets this one back when it ends
        self._threads = torch.get_num_threads()

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the engine thread (idempotent); sets the process's GIL switch interval (see ``SWITCH_INTERVAL_S``)."""
        if self._thread is not None:
            return
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, name="streamkv-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread; requests in flight end as cancelled."""
        if self._thread is None:
            return
        self._stopping.set()
        self._commands.put(Wake())
        await asyncio.to_thread(self._thread.join, 10.0)
        self._thread = None

    # -------------------------------------------------------------- requests

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has ``finished=True``.

        Raises:
            EngineError: on admission failure (see ``EngineCore.validate``),
                or ``engine_stopped`` when the engine thread is not running.
        """
        if self._thread is None or self._stopping.is_set() or self.error is not None:
            raise EngineError(ErrorCode.ENGINE_STOPPED, "the engine is not running")
        self.core.validate(prompt_token_ids, params)
        rid = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def sink(out: RequestOutput | EngineError) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        self._commands.put(AddRequest(rid, list(prompt_token_ids), params, sink, session_id))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                while not isinstance(item, BaseException) and not item.finished and not outputs.empty():
                    nxt = outputs.get_nowait()  # the consumer fell behind: coalesce
                    if isinstance(nxt, BaseException):
                        item = nxt
                        break
                    nxt.deltas = item.deltas + nxt.deltas
                    item = nxt
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(AbortRequest(rid))

    @property
    def stalled(self) -> bool:
        """The engine's watchdog sees steps without progress (``/healthz`` reports ``degraded``)."""
        return self.core.watchdog.stalled

    def release_session(self, session_id: str) -> None:
        """Drop a session's pinned blocks (applied before the next step)."""
        self._commands.put(ReleaseSession(session_id))

    def saved_sessions(self) -> list[tuple[str, list[int]]]:
        """``(session_id, history)`` of conversations saved by ``--kv-offload-dir`` before a restart."""
        return self.core.saved_sessions()

    @property
    def keeps_sessions(self) -> bool:
        """Sessions outlive a shutdown (``--kv-offload-dir``): the server should not release them then."""
        return self.config.cache.kv_offload_dir is not None and self.config.cache.session_offload

    def snapshot(self, session_id: str | None = None, include_blocks: bool = True) -> dict[str, Any]:
        """The last published stats as JSON (see :func:`streamkv.stats.snapshot_json`); safe from any thread."""
        return self.core.snapshot(session_id, include_blocks)

    # --------------------------------------------------------- engine thread

    def _governor(self) -> ThreadGovernor | None:
        """The engine thread's thread governor (``EngineConfig.adaptive_threads``), built on that thread."""
        torch.set_num_threads(self._threads)  # this thread starts at the configured count, whatever ran before
        return self.core.thread_governor(self._threads)

    def _run(self) -> None:
        core = self.core
        governor: ThreadGovernor | None = None
        try:
            governor = self._governor()
            while not self._stopping.is_set():
                if not core.has_work():
                    if governor is not None:
                        governor.pause()
                    try:
                        self._handle(self._commands.get(timeout=_IDLE_WAIT_S))
                    except queue.Empty:
                        continue
                while True:
                    try:
                        self._handle(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if core.has_work():
                    if governor is not None:
                        governor.resume()
                    core.step()
                    if governor is not None:
                        governor.after_step()
        except BaseException as exc:  # noqa: BLE001 - report to every waiter, then die loudly
            logger.exception("engine thread crashed")
            self.error = exc
            core.outputs.fail_all(EngineError(ErrorCode.ENGINE_ERROR, f"engine failed: {exc!r}"))
            raise
        finally:
            try:
                for rid in list(core.requests):
                    core.abort(rid)
                core.close()
            finally:
                if governor is not None:
                    governor.release()  # not 1 for the threads this process starts later

    def _handle(self, command: EngineCommand) -> None:
        core = self.core
        match command:
            case AddRequest(request_id, prompt, params, sink, session_id):
                try:
                    core.add_request(request_id, prompt, params, sink, session_id)
                except EngineError as exc:
                    sink(exc)
            case AbortRequest(request_id):
                core.abort(request_id)
            case ReleaseSession(session_id):
                core.release_session(session_id)
            case Wake():
                pass
