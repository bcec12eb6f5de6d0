"""Ask Linux for transparent huge pages (2 MiB) under a large CPU tensor: the KV pool.

A decode step reads every sequence's blocks, which sit anywhere in a pool of
hundreds of MiB to GiBs. On 4 KiB pages each 6 KiB block span (SmolLM2's 16
tokens x 3 KV heads x 64 dims in bf16) touches two or three pages the TLB has
never seen, so the hardware walks the page table on the way to almost every
block. With the pool on 2 MiB pages its translations fit the TLB.

Linux gives huge pages to anonymous memory that was ``madvise(MADV_HUGEPAGE)``
before its first touch when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always`` or ``madvise`` (the usual default); under ``never`` the advice is a
no-op. :func:`advise_huge_pages` advises the 2 MiB-aligned part of a tensor's
memory; call it on a fresh ``torch.empty`` and only then write the tensor.
Measured in docs/benchmarks.md, "Round 34".
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """``madvise(MADV_HUGEPAGE)`` over the whole 2 MiB pages inside ``tensor``'s memory; the bytes advised.

    Returns 0 (and changes nothing) off Linux, for a non-CPU tensor, for one
    smaller than a huge page, or when the call fails (logged at debug level:
    the tensor works the same on small pages).
    """
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return 0
    start = tensor.data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(first, last - first, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return 0
    return last - first
