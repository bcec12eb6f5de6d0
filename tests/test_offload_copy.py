"""Block copies (every path of ``copy_blocks``) and the host tier's consecutive allocation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkv.cache.block_copy import copy_blocks, gather_blocks, scatter_blocks
from streamkv.cache.swap_space import SwapSpace

NUM_BLOCKS = 24
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn]


def _layer(dtype: torch.dtype, seed: int, num_blocks: int = NUM_BLOCKS, row: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (2, num_blocks, 4, 2, row * torch.empty(0, dtype=dtype).element_size()),
                        dtype=torch.uint8, generator=g)  # fmt: skip
    return raw.view(dtype)  # every bit pattern: the copy is compared byte for byte


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _expected(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> torch.Tensor:
    want = _bytes(dst).clone()
    s = _bytes(src).clone()  # read before any write (copy-on-write sources are never destinations)
    for a, b in zip(src_ids, dst_ids, strict=True):
        want[:, b] = s[:, a]
    return want


@st.composite
def id_lists(draw: st.DrawFn) -> tuple[list[int], list[int], bool]:
    """Source and destination ids in the shapes the callers make (runs, one run, scattered), maybe one tensor."""
    n = draw(st.integers(1, 10))
    same = draw(st.booleans())
    kind = draw(st.sampled_from(["scattered", "dst_run", "src_run", "both_runs"]))
    perm = draw(st.permutations(range(NUM_BLOCKS)))
    if kind == "both_runs":  # several runs, as a swap of consecutive blocks into a consecutive host run
        a, b = draw(st.integers(0, 2)), draw(st.integers(12, NUM_BLOCKS - n))
        src, dst = list(range(a, a + n)), list(range(b, b + n))
    elif kind == "dst_run":
        b = draw(st.integers(0, NUM_BLOCKS - n))
        dst = list(range(b, b + n))
        src = [i for i in perm if i not in dst][:n]
    elif kind == "src_run":
        a = draw(st.integers(0, NUM_BLOCKS - n))
        src = list(range(a, a + n))
        dst = [i for i in perm if i not in src][:n]
    else:
        src, dst = perm[:n], perm[n : 2 * n]
    return src, dst, same


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=60, deadline=None)
@given(case=id_lists(), seed=st.integers(0, 2**16))
def test_copy_blocks_equals_a_block_by_block_copy(dtype: torch.dtype, case: tuple[list[int], list[int], bool],
                                                  seed: int) -> None:  # fmt: skip
    src_ids, dst_ids, same = case
    src = _layer(dtype, seed)
    dst = src if same else _layer(dtype, seed + 1)
    want = _expected(src, dst, src_ids, dst_ids)
    copy_blocks([[src]], [[dst]], src_ids, dst_ids)
    assert torch.equal(_bytes(dst), want)


def test_copy_blocks_of_a_view_that_is_not_contiguous() -> None:
    src = _layer(torch.float32, 1).transpose(3, 4)
    dst = torch.zeros_like(src)
    copy_blocks([[src]], [[dst]], [3, 1, 7], [0, 5, 2])
    assert torch.equal(_bytes(dst[:, [0, 5, 2]]), _bytes(src[:, [3, 1, 7]]))
    assert not dst[:, 1].any()


def test_gather_then_scatter_round_trips_many_layers() -> None:
    tier = [[_layer(torch.bfloat16, s)] for s in range(3)]
    ids = [9, 2, 3, 4, 17]
    data = gather_blocks(tier, ids)
    assert [tuple(d[0].shape) for d in data] == [(2, 5, 4, 2, 8)] * 3 and all(d[0].is_contiguous() for d in data)
    other = [[torch.zeros_like(layer[0])] for layer in tier]
    scatter_blocks(other, [0, 1, 2, 20, 21], data)
    for got, layer in zip(other, tier, strict=True):
        assert torch.equal(_bytes(got[0][:, [0, 1, 2, 20, 21]]), _bytes(layer[0][:, ids]))


def test_copy_blocks_refuses_mismatched_lists() -> None:
    t = _layer(torch.float32, 0)
    with pytest.raises(ValueError, match="2 source blocks for 1"):
        copy_blocks([[t]], [[t]], [1, 2], [3])
    with pytest.raises(ValueError, match="layers"):
        copy_blocks([[t]], [[t], [t]], [1], [3])


def test_swap_space_hands_out_consecutive_runs_lowest_first() -> None:
    space = SwapSpace(32)
    a, b, c = space.allocate(5), space.allocate(4), space.allocate(6)
    assert a == [0, 1, 2, 3, 4] and b == [5, 6, 7, 8] and c == list(range(9, 15))
    space.free(b)
    assert space.allocate(3) == [5, 6, 7]  # handed-back pages first (already written)
    assert space.allocate(2) == [15, 16]  # no run of 2 handed back: a fresh run
    space.free(a)
    space.free(c)
    assert space.num_free_blocks == 32 - 5
    assert space.allocate(6) == list(range(8, 14))  # 8 was left of b
    rest = space.allocate(space.num_free_blocks)  # no run left: every free id, each once
    assert len(rest) == len(set(rest)) == 32 - 11 and not set(rest) & {5, 6, 7, 15, 16, *range(8, 14)}
    assert space.num_free_blocks == 0
    with pytest.raises(ValueError, match="asked for 1 host blocks, 0 free"):
        space.allocate(1)


def test_swap_space_refuses_bad_frees_and_changes_nothing() -> None:
    space = SwapSpace(8)
    ids = space.allocate(3)
    for bad in ([ids[0], ids[0]], [7], [-1], [8]):
        with pytest.raises(ValueError, match="bad host block free"):
            space.free(bad)
        assert space.num_free_blocks == 5
    space.free(ids)
    with pytest.raises(ValueError, match="bad host block free"):
        space.free([ids[1]])
    assert space.num_free_blocks == 8
