"""TritonPagedAttention.forward: store then attend, vs the dense oracle and the torch backend."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from kernels_oracle import PagedCase, assert_close, dense_attention, make_case  # noqa: E402

from streamkv.attention.triton_paged import TritonPagedAttention  # noqa: E402

# query_lens / seq_lens per step: pure decode (the split-K kernel) and mixed
# batches of decodes, extends and fresh prefills (the prefill kernel).
STEPS = [
    # dtype, head_dim, block_size, num_heads, num_kv_heads, query_lens, seq_lens
    (torch.float32, 64, 16, 8, 2, [1, 1, 1], [1, 40, 300]),
    (torch.bfloat16, 128, 8, 12, 4, [1, 1], [9, 130]),
    (torch.float16, 64, 128, 8, 1, [1, 1, 17, 30], [200, 5, 60, 30]),
    (torch.bfloat16, 64, 16, 4, 4, [1, 70, 1, 9], [1, 70, 33, 41]),
    (torch.float32, 128, 32, 6, 2, [3, 1, 20], [50, 77, 20]),
]


def _case(dtype: torch.dtype, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int,
          query_lens: list[int], seq_lens: list[int], store_new: bool, device: str = "cpu") -> PagedCase:
    return make_case(
        query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=device, layout="permuted", store_new=store_new,
        strided_query=True, seed=len(query_lens),
    )


def _check_forward(*args: object, device: str = "cpu") -> None:
    step = _case(*args, store_new=False, device=device)  # type: ignore[misc]
    stored = _case(*args, store_new=True, device=device)  # type: ignore[misc]
    scale = step.query.shape[-1] ** -0.5
    out = TritonPagedAttention().forward(step.query, step.key, step.value, step.kv_cache, step.meta(), scale)

    torch.testing.assert_close(step.kv_cache, stored.kv_cache, atol=0, rtol=0, equal_nan=True)
    assert out.shape == step.query.shape and out.dtype == step.query.dtype
    assert_close(out, dense_attention(step.query, stored.kv_cache, step.block_tables, step.query_lens,
                                      step.seq_lens, scale))


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size", "num_heads", "num_kv_heads", "query_lens", "seq_lens"), STEPS
)
def test_forward_stores_then_attends(dtype: torch.dtype, head_dim: int, block_size: int, num_heads: int,
                                     num_kv_heads: int, query_lens: list[int], seq_lens: list[int]) -> None:
    _check_forward(dtype, head_dim, block_size, num_heads, num_kv_heads, query_lens, seq_lens)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size", "num_heads", "num_kv_heads", "query_lens", "seq_lens"), STEPS
)
def test_forward_matches_torch_backend(dtype: torch.dtype, head_dim: int, block_size: int, num_heads: int,
                                       num_kv_heads: int, query_lens: list[int], seq_lens: list[int]) -> None:
    torch_paged = pytest.importorskip("streamkv.attention.torch_paged")
    step = _case(dtype, head_dim, block_size, num_heads, num_kv_heads, query_lens, seq_lens, store_new=False)
    scale = head_dim**-0.5
    meta = step.meta()
    cache_torch = step.kv_cache.clone()
    expected = torch_paged.TorchPagedAttention().forward(step.query, step.key, step.value, cache_torch, meta, scale)
    out = TritonPagedAttention().forward(step.query, step.key, step.value, step.kv_cache, meta, scale)

    torch.testing.assert_close(step.kv_cache, cache_torch, atol=0, rtol=0, equal_nan=True)
    assert_close(out, expected)


def test_forward_rejects_block_size_mismatch() -> None:
    step = _case(torch.float32, 64, 16, 2, 1, [1], [5], store_new=False)
    meta = step.meta()
    meta.block_size = 8
    with pytest.raises(ValueError, match="block size"):
        TritonPagedAttention().forward(step.query, step.key, step.value, step.kv_cache, meta, 0.125)


def test_backend_name() -> None:
    assert TritonPagedAttention.name == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_forward_cuda(dtype: torch.dtype) -> None:
    # A decode step over long contexts, then a chunked-prefill step mixing decodes and chunks.
    _check_forward(dtype, 128, 16, 32, 8, [1] * 6, [1, 16, 17, 2000, 5000, 700], device="cuda")
    _check_forward(dtype, 128, 16, 32, 8, [1, 1, 512, 256, 40], [3000, 9, 512, 1500, 41], device="cuda")
