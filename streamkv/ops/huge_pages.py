"""A zeroed CPU tensor on transparent huge pages (2 MiB): the KV pool.

A decode step reads every sequence's blocks, which sit anywhere in a pool of
hundreds of MiB to GiBs. On 4 KiB pages each 6 KiB block span (SmolLM2's 16
tokens x 3 KV heads x 64 dims in bf16) touches two or three pages the TLB has
never seen, so the hardware walks the page table on the way to almost every
block. With the pool on 2 MiB pages its translations fit the TLB.

Linux gives huge pages to anonymous memory advised ``MADV_HUGEPAGE`` before
its first touch when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always`` or ``madvise`` (the usual default); under ``never`` the advice
does nothing. A pool from ``torch.zeros`` may come from glibc's heap, whose
pages the model load already touched (a CPU engine serves blocks up to
32 MiB from the heap: ``host_malloc.py``), so :func:`zeros_on_huge_pages`
maps fresh memory of its own, aligned to 2 MiB, advises it, and only then
writes it. Measured in docs/benchmarks.md, "Round 34".
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros, on 2 MiB pages where the kernel gives them.

    The memory is an anonymous mapping of the tensor's own (kept alive by the
    tensor), its start aligned to 2 MiB and advised ``MADV_HUGEPAGE`` before
    the zeros are written, so every page is committed at once as
    ``torch.zeros`` commits it. Off Linux, below 2 MiB, or when the mapping or
    the advice fails (logged at debug level), it is ``torch.zeros``.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):  # MADV_HUGEPAGE: Linux only
        return torch.zeros(shape, dtype=dtype, device="cpu")
    try:
        # Private: a shared anonymous mapping is shmem, which takes huge pages only under shmem_enabled.
        region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        offset = -base % HUGE_PAGE_BYTES  # a multiple of the 4 KiB page, as madvise wants
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    except (OSError, ValueError) as exc:
        logger.debug("no huge pages for a %d-byte tensor (%s); torch.zeros instead", nbytes, exc)
        return torch.zeros(shape, dtype=dtype, device="cpu")
    flat = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).view(shape).zero_()  # the first touch, after the advice
