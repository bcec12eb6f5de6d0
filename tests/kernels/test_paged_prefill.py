"""Paged prefill / extend (causal chunk over a cached context) vs the dense oracle."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from kernels_oracle import PagedCase, assert_close, dense_attention, make_case  # noqa: E402

from streamkv.kernels import paged_prefill  # noqa: E402


def _check(case: PagedCase) -> None:
    meta = case.meta()
    scale = case.query.shape[-1] ** -0.5
    out = paged_prefill(
        case.query,
        case.kv_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale,
        max_query_len=meta.max_query_len,
    )
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    ref = dense_attention(case.query, case.kv_cache, case.block_tables, case.query_lens, case.seq_lens, scale)
    assert_close(out, ref)


# Fresh prefills (query_len == seq_len), extends over a cached context ending
# mid-block, decode rows inside a mixed batch, one-token contexts, and chunks
# longer than one BLOCK_M tile (64 for 16-bit, 32 for fp32).
PREFILL_CASES = [
    # dtype, head_dim, block_size, num_heads, num_kv_heads, query_lens, seq_lens, layout, strided
    (torch.float32, 64, 16, 4, 4, [1, 7, 40], [1, 30, 40], "permuted", False),
    (torch.bfloat16, 128, 8, 6, 2, [70, 3], [100, 3], "reversed", True),
    (torch.float16, 64, 128, 8, 2, [20, 1, 5], [150, 1, 133], "permuted", False),
    (torch.float32, 128, 32, 8, 1, [33, 1], [90, 47], "reversed", False),
    (torch.bfloat16, 64, 16, 3, 1, [9], [9], "permuted", True),
]


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size", "num_heads", "num_kv_heads", "query_lens", "seq_lens", "layout", "strided"),
    PREFILL_CASES,
)
def test_paged_prefill_matches_dense(dtype: torch.dtype, head_dim: int, block_size: int, num_heads: int,
                                     num_kv_heads: int, query_lens: list[int], seq_lens: list[int], layout: str,
                                     strided: bool) -> None:
    _check(
        make_case(
            query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            block_size=block_size, dtype=dtype, layout=layout, strided_query=strided,
        )
    )


def _sweep() -> list[tuple[torch.dtype, int, int, int, int]]:
    """Every dtype x GQA ratio once; block sizes 8..128 and head dims cycle through them."""
    cases = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for group in (1, 3, 4, 8):
            n = len(cases)
            cases.append((dtype, (128, 64)[n % 2], (8, 16, 32, 64, 128)[n % 5], group, n))
    return cases


@pytest.mark.parametrize(("dtype", "head_dim", "block_size", "group", "seed"), _sweep())
def test_paged_prefill_sweep(dtype: torch.dtype, head_dim: int, block_size: int, group: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    # A fresh prefill, an extend over a context ending mid-block, and a decode row.
    fresh = int(torch.randint(1, 40, (1,), generator=gen))
    chunk = int(torch.randint(2, 40, (1,), generator=gen))
    cached = int(torch.randint(1, 2 * block_size + 3, (1,), generator=gen))
    decode_ctx = int(torch.randint(1, 100, (1,), generator=gen))
    _check(
        make_case(
            [fresh, chunk, 1], [fresh, cached + chunk, decode_ctx], num_heads=group, num_kv_heads=1,
            head_dim=head_dim, block_size=block_size, dtype=dtype, layout=("permuted", "reversed")[seed % 2],
            seed=seed,
        )
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), [(32, 8, 128, 16), (12, 4, 64, 128)])
def test_paged_prefill_cuda(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                            block_size: int) -> None:
    query_lens = [512, 1, 300, 77, 1]
    seq_lens = [512, 4000, 2300, 77, 1]
    _check(
        make_case(
            query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            block_size=block_size, dtype=dtype, device="cuda", strided_query=True,
        )
    )
