"""The KV pool on transparent huge pages: a fresh 2 MiB-aligned mapping, advised before its zeros are written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamkv.ops.huge_pages import HUGE_PAGE_BYTES, zeros_on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_ON = sys.platform.startswith("linux") and THP.exists() and "[never]" not in THP.read_text()


def huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mapping that holds ``t``'s first byte (/proc/self/smaps)."""
    addr, total, inside = t.data_ptr(), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if not head.endswith(":"):  # a mapping's first line: "lo-hi perms offset dev inode [path]"
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_zeros_of_any_size_and_dtype(dtype: torch.dtype) -> None:
    for shape in ((3, 5), (2, 700, 16, 3, 64), (5 * HUGE_PAGE_BYTES // 4 + 7,)):
        t = zeros_on_huge_pages(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
        assert not t.view(torch.uint8).any()
        t.fill_(1)  # writable, and its own memory: the next tensor is zeros again
        assert bool((t == 1).all())


@pytest.mark.skipif(not THP_ON, reason="transparent huge pages are off (or this is not Linux)")
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_cpu_pool_starts_on_a_2_mib_boundary_on_huge_pages(kv_dtype: str) -> None:
    # In a process of its own, so what earlier tests did to this one's heap and mappings cannot decide it.
    script = f"""
import torch
from streamkv.attention.kv_layout import allocate_kv_cache, resolve_kv_format
from streamkv.ops.huge_pages import HUGE_PAGE_BYTES
from tests.test_huge_pages import huge_kib
cache = allocate_kv_cache(resolve_kv_format({kv_dtype!r}, torch.bfloat16), 4096, 16, 3, 64)  # 48 / 26 MiB
print(cache.data_ptr() % HUGE_PAGE_BYTES, int(cache.view(torch.uint8).any()), huge_kib(cache))
"""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    misalign, nonzero, kib = (int(x) for x in done.stdout.split())
    assert misalign == 0 and nonzero == 0
    assert kib > 0  # a pool from torch.zeros reads 0 here (4 KiB pages)
