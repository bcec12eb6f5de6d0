"""Keep the pages of freed step buffers: glibc's malloc thresholds for a CPU engine.

A CPU step allocates its activations afresh (torch's CPU allocator caches
nothing): a 4,096-token prefill makes tensors of 1-16 MB per op and layer. glibc
serves a block above its mmap threshold (128 KiB at first, raised as such
blocks are freed, up to 32 MiB) with its own ``mmap`` and unmaps it on free,
and trims the heap top past 128 KiB, so every step touches fresh pages again
and pays a page fault per 4 KiB. In the 32 x 128-token bf16 prefill those faults
were ~15% of the step: RoPE's output, written once, took 50 ms against 10 ms
on reused pages (docs/benchmarks.md, "Freed memory kept for the next step").

:func:`retain_freed_memory` sets the mmap threshold to its largest value
(blocks up to 32 MiB come from the heap) and the trim threshold to
``trim_threshold`` bytes (freed memory at the heap top is returned to the
system only past that), so the pages of one step serve the next. The cost is
resident memory: at most about ``trim_threshold`` bytes of freed heap stay
mapped per malloc arena. This is what vLLM's CPU backend gets from preloading
tcmalloc, without a preload.
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
