"""The KV pool on transparent huge pages: advice over whole 2 MiB pages inside the tensor; the pool stays zeros."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from streamkv.attention.kv_layout import allocate_kv_cache, resolve_kv_format
from streamkv.ops.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages

LINUX = sys.platform.startswith("linux")


@pytest.mark.skipif(not LINUX, reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_advice_covers_the_whole_huge_pages_inside_the_tensor() -> None:
    t = torch.empty(5 * HUGE_PAGE_BYTES + 12345, dtype=torch.uint8)
    advised = advise_huge_pages(t)
    start, end = t.data_ptr(), t.data_ptr() + t.numel()
    # every whole 2 MiB page between start and end, and nothing outside
    assert advised == (end // HUGE_PAGE_BYTES - -(-start // HUGE_PAGE_BYTES)) * HUGE_PAGE_BYTES
    assert advised >= 4 * HUGE_PAGE_BYTES


def test_no_advice_for_a_tensor_smaller_than_a_huge_page() -> None:
    assert advise_huge_pages(torch.empty(1000)) == 0  # smaller than a huge page


@pytest.mark.skipif(not LINUX, reason="madvise(MADV_HUGEPAGE) is Linux's")
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_large_cpu_pool_is_zeros_and_lies_on_huge_pages_where_the_kernel_gives_them(kv_dtype: str) -> None:
    fmt = resolve_kv_format(kv_dtype, torch.bfloat16)
    cache = allocate_kv_cache(fmt, 4096, 16, 3, 64)  # 48 MiB in bf16, 26 MiB in int8
    assert not cache.view(torch.uint8).any()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this kernel")
    # The advised part of the pool is its own mapping (madvise split it off) from the first whole 2 MiB page on;
    # its pages should be huge ones (AnonHugePages), unless memory was too fragmented to give a single one.
    first = -(-cache.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    huge_kb, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if not head.endswith(":"):  # a mapping's first line: "lo-hi perms offset dev inode [path]"
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= first < hi
        elif inside and head == "AnonHugePages:":
            huge_kb += int(line.split()[1])
    assert huge_kb > 0
