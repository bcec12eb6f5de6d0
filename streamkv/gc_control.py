"""Python's cyclic garbage collector around model loading and serving.

Loading the default GGUF builds ~630k tracked objects (transformers parses the
file, dequantizes every tensor, builds the tokenizer), and each of the ~25
full collections it triggers walks all of them: ``LLM()`` took 14.4-14.7 s on
the 2-core host with the collector on and 10.3-10.5 s with it paused for the
load and run once at its end (docs/benchmarks.md, "Round 19").
:func:`gc_paused` turns the collector off for the load and restores it after.

A server then keeps ~390k long-lived objects for its whole life, and a full
collection walks them all, holding the GIL and so stalling the engine thread:
120-160 ms a collection on that host. :func:`freeze_startup_heap` collects
once and moves what survives into the permanent generation
(``gc.freeze()``), which later collections skip (then under 0.1 ms), as vLLM
does after its warm-up (``freeze_gc_heap``) and SGLang with ``freeze_gc``.
Frozen objects are still freed by reference counting; a cycle among them
would stay until ``gc.unfreeze()``, so only a process that serves one engine
for its life (the server, a Ray replica) freezes, never the offline ``LLM``
that tests build by the hundred.

:class:`CollectionTimer` times every collection a serving process makes, for
``streamkv_gc_pause_seconds{generation}``: a pause that still happens shows
on the dashboard next to the ITL it stretched.
"""

from __future__ import annotations

import atexit
import collections
import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Cyclic collection off inside the block; on again after it, if it was on before (nesting keeps it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_startup_heap() -> float:
    """Collect once, then freeze every surviving object out of later collections.

    Returns:
        The seconds a full collection took just before the freeze (what each one
        would have cost the engine thread without it), also logged with the
        number of objects frozen.
    """
    start = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - start
    gc.freeze()
    # At exit the interpreter's last collections must see these objects again: frozen, triton's nanobind
    # bindings outlive it and print "leaked function" warnings on every shutdown.
    atexit.register(gc.unfreeze)
    logger.info(
        "froze %d objects of the start-up heap out of garbage collection (a full collection took %.0f ms)",
        gc.get_freeze_count(),
        seconds * 1000,
    )
    return seconds


class CollectionTimer:
    """Times each garbage collection of this process through ``gc.callbacks``, until :meth:`close`.

    The callback runs inside the collector, in whatever thread allocated,
    holding the GIL; it only appends ``(generation, seconds)`` to a bounded
    deque (no lock taken, so a thread already inside a metric's lock cannot
    deadlock against it). :meth:`drain` hands the pauses to ``observe`` later,
    at each ``/metrics`` scrape.

    Args:
        max_pending: pauses kept between drains; past it the oldest are dropped
            (counted in :attr:`dropped`). 4,096 is minutes of the busiest rate
            seen (~2 young collections a second while serving).
    """

    def __init__(self, max_pending: int = 4096) -> None:
        self._pending: collections.deque[tuple[int, float]] = collections.deque(maxlen=max_pending)
        self._start = 0.0
        self.dropped = 0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        # Collections never nest (the collector is not reentrant), so one start time serves every thread.
        if phase == "start":
            self._start = time.perf_counter()
            return
        if len(self._pending) == self._pending.maxlen:
            self.dropped += 1
        self._pending.append((info["generation"], time.perf_counter() - self._start))

    def drain(self, observe: Callable[[int, float], None]) -> None:
        """Call ``observe(generation, seconds)`` for each pause since the last drain, oldest first.

        Two scrapes may drain at once (each renders in a worker thread): each pause goes to one of them.
        """
        while True:
            try:
                generation, seconds = self._pending.popleft()
            except IndexError:  # empty, perhaps emptied by the other drain between a check and a pop
                return
            observe(generation, seconds)

    def close(self) -> None:
        """Stop timing (pending pauses stay drainable)."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
