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
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
from collections.abc import Iterator
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
