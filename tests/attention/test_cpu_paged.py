"""CpuPagedAttention (the C++ in-place decode) against the torch reference and the dense oracle.

Every pool starts NaN-poisoned (see ``run_case``): a read of any slot the
kernel should not touch (padding of a block table, the unwritten tail of a
partial block, another sequence's blocks) turns the output NaN.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from streamkv.attention.metadata import AttentionMetadata
from streamkv.attention.torch_paged import TorchPagedAttention
from tests.attention.test_torch_paged import Case, cases, run_case

cpu_paged = pytest.importorskip("streamkv.attention.cpu_paged")
if not cpu_paged.cpu_ops_available():
    pytest.skip("the streamkv C++ CPU ops cannot be built here", allow_module_level=True)


def compare(case: Case, dtype: torch.dtype = torch.float32, head_dim: int = 8) -> None:
    """The C++ backend matches the torch reference (same pool, same step) and the float64 oracle."""
    ours, oracle, cache_ours = run_case(case, dtype, cpu_paged.CpuPagedAttention(), head_dim)
    ref, _, cache_ref = run_case(case, dtype, TorchPagedAttention(), head_dim)
    assert ours.dtype == dtype and ours.shape == ref.shape
    assert not ours.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours.double(), oracle, atol=tol, rtol=0)
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=0)
    torch.testing.assert_close(cache_ours, cache_ref, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(3, 3), (9, 3), (8, 2)])
def test_pure_decode_partial_blocks_and_gqa(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    seq_lens = [1, 7, 16, 17, 33, 5]  # one token, mid-block, block edges, past an edge
    compare(Case([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, 8, 20, "shuffled", seed=2), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32)])
def test_vectorised_head_dims_long_context(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    # SmolLM2 (9 on 3 heads, head_dim 64) and Llama-style 128 take the AVX-512 kernel, 32 the portable
    # one; contexts up to ~700 in 16-token blocks, lengths off every multiple of 16 (masked lanes).
    seq_lens = [700, 129, 1, 400, 16, 47]
    num_blocks = sum(-(-s // 16) for s in seq_lens) + 4
    case = Case([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, 16, num_blocks, "reversed", seed=11)
    compare(case, dtype, head_dim=head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_decode_rows_take_the_kernel(dtype: torch.dtype) -> None:
    # Decodes first (contiguous run) and decodes scattered between chunks (indexed run).
    compare(Case([1, 5, 9, 1, 13, 1], [21, 12, 9, 16, 13, 1], 6, 2, 4, 40, "shuffled", seed=1), dtype)
    compare(Case([3, 1, 4, 1, 1], [10, 9, 4, 30, 2], 4, 2, 4, 30, "shuffled", seed=5), dtype)


def test_query_with_strides_of_the_fused_qkv() -> None:
    # The model hands over q as a view of the fused [T, Hq + Hkv, D] RoPE output.
    meta = AttentionMetadata.build([1, 1], [5, 20], [[3, 0], [1, 2]], 16)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 4, 16, 2, 8, generator=gen)
    qk = torch.randn(2, 6, 8, generator=gen)
    q, k, v = qk[:, :4], qk[:, 4:], torch.randn(2, 2, 8, generator=gen)
    ours = cpu_paged.CpuPagedAttention().forward(q, k, v, kv.clone(), meta, 0.3)
    ref = TorchPagedAttention().forward(q.contiguous(), k.contiguous(), v, kv.clone(), meta, 0.3)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


def test_kernel_rejects_bad_inputs_clearly() -> None:
    ops = cpu_paged.load_cpu_ops()
    kv = torch.zeros(2, 2, 4, 1, 8)
    q = torch.zeros(1, 2, 8)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_decode(torch.empty_like(q), q, kv, tables.long(), lens, 1.0)
    with pytest.raises(RuntimeError, match="head_dim"):
        ops.paged_decode(torch.empty(1, 2, 4), q[..., :4], kv, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        ops.paged_decode(torch.empty(1, 3, 8), torch.zeros(1, 3, 8), torch.zeros(2, 2, 4, 2, 8), tables, lens, 1.0)


@pytest.mark.parametrize("head_dim", [8, 64])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(case=cases())
def test_random_batches_match_reference(case: Case, head_dim: int) -> None:
    compare(case, head_dim=head_dim)
