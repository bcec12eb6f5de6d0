"""The async front of the engine: an engine thread plus per-request asyncio queues.

The event loop never runs model compute. ``generate`` validates, enqueues
an ``add`` command for the engine thread and awaits that request's queue;
the engine thread hands each :class:`RequestOutput` back with
``loop.call_soon_threadsafe``. Closing the generator early enqueues an
``abort``, which the engine applies before its next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

from streamkv.config import EngineConfig
from streamkv.engine_core import EngineCore
from streamkv.errors import EngineError
from streamkv.metrics_hooks import MetricsHooks
from streamkv.model.chat import ChatFormatter
from streamkv.model.loader import LoadedModel
from streamkv.outputs import RequestOutput
from streamkv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


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
        self.core = EngineCore(config, metrics, loaded)
        self.tokenizer = self.core.tokenizer
        self.chat = ChatFormatter(self.tokenizer)
        self.max_model_len = self.core.max_model_len
        self.eos_token_ids = tuple(self.core.loaded.eos_token_ids)
        self.model_name = self.core.loaded.name
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="streamkv-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread; requests in flight end as cancelled."""
        if self._thread is None:
            return
        self._stopping.set()
        self._commands.put(("wake", None))
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
            raise EngineError("engine_stopped", "the engine is not running")
        self.core.validate(prompt_token_ids, params)
        rid = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def sink(out: object) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        self._commands.put(("add", (rid, list(prompt_token_ids), params, sink, session_id)))
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
                self._commands.put(("abort", rid))

    @property
    def stalled(self) -> bool:
        """The engine's watchdog sees steps without progress (``/healthz`` reports ``degraded``)."""
        return self.core.watchdog.stalled

    def release_session(self, session_id: str) -> None:
        """Drop a session's pinned blocks (applied before the next step)."""
        self._commands.put(("release", session_id))

    def snapshot(self, session_id: str | None = None, include_blocks: bool = True) -> dict:
        """Stats snapshot (see :func:`streamkv.stats.build_snapshot`); safe from any thread."""
        return self.core.snapshot(session_id, include_blocks)

    # --------------------------------------------------------- engine thread

    def _run(self) -> None:
        core = self.core
        try:
            while not self._stopping.is_set():
                if not core.has_work():
                    try:
                        self._handle(*self._commands.get(timeout=_IDLE_WAIT_S))
                    except queue.Empty:
                        continue
                while True:
                    try:
                        self._handle(*self._commands.get_nowait())
                    except queue.Empty:
                        break
                if core.has_work():
                    core.step()
        except BaseException as exc:  # noqa: BLE001 - report to every waiter, then die loudly
            logger.exception("engine thread crashed")
            self.error = exc
            for req in list(core.requests.values()):
                req.sink(EngineError("engine_error", f"engine failed: {exc!r}"))
            raise
        finally:
            for rid in list(core.requests):
                core.abort(rid)

    def _handle(self, kind: str, arg: Any) -> None:
        core = self.core
        if kind == "add":
            rid, prompt, params, sink, session_id = arg
            try:
                core.add_request(rid, prompt, params, sink, session_id)
            except EngineError as exc:
                sink(exc)
        elif kind == "abort":
            core.abort(arg)
        elif kind == "release":
            core.release_session(arg)
