"""Keep the pages of freed step buffers: glibc's malloc thresholds for a CPU engine.

A CPU step allocates its activations afresh (torch's CPU allocator caches
nothing): a 4,096-token prefill makes tensors of 1-16 MB per op and layer.
glibc starts with an mmap threshold and a trim threshold of 128 KiB (raising
both as mmapped blocks are freed: the mmap threshold to the freed block's
size, up to 32 MiB, the trim threshold to twice that): a block above the
mmap threshold is its own ``mmap``, unmapped on free, and free memory past
the trim threshold at the heap top goes back to the system, so a step often
touches fresh pages again and pays a page fault per 4 KiB. In the 32 x
128-token bf16 prefill those faults were ~15% of the step: RoPE's output,
written once, took 50 ms against 10 ms on reused pages (docs/benchmarks.md,
"Freed memory kept for the next step").

:func:`retain_freed_memory` sets the mmap threshold to its largest value
(blocks up to 32 MiB come from the heap) and the trim threshold to
``trim_threshold`` bytes, so the pages of one step serve the next. This is
what vLLM's CPU backend gets from preloading tcmalloc, without a preload.
The settings are process-wide (the offline ``LLM`` sets them for its host
program too). Limits:

- The main arena (the main thread's: the offline ``LLM``) keeps up to about
  ``trim_threshold`` bytes free at its top, plus any free holes below it
  (glibc never returns those).
- Other threads (the server's engine thread) allocate from arenas of 64 MiB
  heaps that glibc unmaps whenever one is wholly free, whatever the
  threshold: there the settings keep fewer pages than on the main thread
  (a synthetic probe of a review, thresholds first pinned at 128 KiB:
  87,573 faults without them, 1,536 on the main thread and 24,579 on
  another thread with them).
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

# mallopt parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): 4 MiB * sizeof(long).
MMAP_THRESHOLD_MAX = 32 * 2**20
DEFAULT_TRIM_THRESHOLD = 256 * 2**20


def retain_freed_memory(trim_threshold: int = DEFAULT_TRIM_THRESHOLD) -> bool:
    """Have glibc's malloc serve blocks up to 32 MiB from the heap and keep up to ``trim_threshold`` bytes freed.

    Process-wide and idempotent. Linux with glibc only; elsewhere nothing changes.

    Args:
        trim_threshold: bytes of free memory at the heap top kept before glibc returns it to the system.

    Returns:
        True when both settings took effect.

    Raises:
        ValueError: ``trim_threshold`` is negative or does not fit a C int.
    """
    if not 0 <= trim_threshold < 2**31:
        raise ValueError(f"trim_threshold must be in [0, 2**31), not {trim_threshold}")
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
    if ok:
        logger.info(
            "malloc: blocks up to %d MiB from the heap, up to %d MiB of freed memory kept for the next step",
            MMAP_THRESHOLD_MAX >> 20,
            trim_threshold >> 20,
        )
    return ok
