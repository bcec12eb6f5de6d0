"""Split-K paged decode vs the dense oracle."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from kernels_oracle import PagedCase, assert_close, dense_attention, make_case  # noqa: E402

from streamkv.kernels import paged_decode  # noqa: E402
from streamkv.kernels.paged_decode import default_num_splits  # noqa: E402


def _run(case: PagedCase, num_splits: int | None) -> torch.Tensor:
    meta = case.meta()
    return paged_decode(
        case.query,
        case.kv_cache,
        meta.block_tables,
        meta.seq_lens,
        case.query.shape[-1] ** -0.5,
        max_seq_len=meta.max_seq_len,
        num_splits=num_splits,
    )


def _check(case: PagedCase, num_splits: int | None) -> None:
    out = _run(case, num_splits)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    ref = dense_attention(
        case.query, case.kv_cache, case.block_tables, case.query_lens, case.seq_lens, case.query.shape[-1] ** -0.5
    )
    assert_close(out, ref)


# seq_lens end mid-block, include one-token contexts, and with num_splits > 1
# the longest ones span several partitions (64-token tiles per partition).
DECODE_CASES = [
    # dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, num_splits, layout, strided
    (torch.float32, 64, 16, 4, 4, [1, 17, 200], 4, "permuted", False),
    (torch.float16, 128, 8, 12, 4, [5, 33, 300], 4, "reversed", True),
    (torch.bfloat16, 64, 128, 8, 2, [1, 129, 700], 8, "permuted", False),
    (torch.float32, 128, 32, 8, 1, [1000], None, "permuted", False),
    (torch.bfloat16, 128, 16, 32, 8, [17, 2], None, "reversed", False),
    (torch.float16, 64, 64, 3, 1, [1, 63, 65], 2, "permuted", True),
]


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size", "num_heads", "num_kv_heads", "seq_lens", "num_splits", "layout", "strided"),
    DECODE_CASES,
)
def test_paged_decode_matches_dense(dtype: torch.dtype, head_dim: int, block_size: int, num_heads: int,
                                    num_kv_heads: int, seq_lens: list[int], num_splits: int | None, layout: str,
                                    strided: bool) -> None:
    case = make_case(
        [1] * len(seq_lens), seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, layout=layout, strided_query=strided,
    )
    _check(case, num_splits)


def _sweep() -> list[tuple[torch.dtype, int, int, int, int]]:
    """Every dtype x GQA ratio once; block sizes 8..128 and head dims cycle through them."""
    cases = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for group in (1, 3, 4, 8):
            n = len(cases)
            cases.append((dtype, (64, 128)[n % 2], (8, 16, 32, 64, 128)[n % 5], group, n))
    return cases


@pytest.mark.parametrize(("dtype", "head_dim", "block_size", "group", "seed"), _sweep())
def test_paged_decode_sweep(dtype: torch.dtype, head_dim: int, block_size: int, group: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    # One-token context, one ending mid-block, one spanning 2-4 partitions of 64-token tiles.
    seq_lens = [1, int(torch.randint(2, 3 * block_size, (1,), generator=gen)),
                int(torch.randint(129, 260, (1,), generator=gen))]
    num_kv_heads = 2 if group < 8 else 1
    case = make_case(
        [1] * 3, seq_lens, num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, layout=("permuted", "reversed")[seed % 2], seed=seed,
    )
    _check(case, 4)


def test_paged_decode_split_count_does_not_change_result() -> None:
    case = make_case([1, 1], [450, 77], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    one = _run(case, 1)
    for splits in (3, 7):
        torch.testing.assert_close(_run(case, splits), one, atol=1e-6, rtol=1e-6)


def test_default_num_splits() -> None:
    assert default_num_splits(1, 8, 32768) == 64
    assert default_num_splits(1, 8, 1000) == 4
    assert default_num_splits(128, 8, 32768) == 1
    assert default_num_splits(4, 1, 1) == 1


def test_paged_decode_rejects_dtype_mismatch() -> None:
    case = make_case([1], [5], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8, dtype=torch.float32)
    meta = case.meta()
    with pytest.raises(ValueError):
        paged_decode(case.query.half(), case.kv_cache, meta.block_tables, meta.seq_lens, 0.1, max_seq_len=5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (24, 8, 64), (8, 8, 128)])
def test_paged_decode_cuda(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    seq_lens = [1, 15, 16, 17, 1000, 4097, 9000, 333]
    case = make_case(
        [1] * len(seq_lens), seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=16, dtype=dtype, device="cuda", strided_query=True,
    )
    _check(case, None)
    _check(case, 16)
