"""TorchPagedAttention against a dense attention oracle written out here."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkv.attention.backend import AttentionBackend
from streamkv.attention.metadata import AttentionMetadata
from streamkv.attention.torch_paged import TorchPagedAttention

HEAD_DIM = 8


@dataclass(slots=True)
class Case:
    """One step of a batch: per sequence, its full K/V history and how many tokens are new."""

    query_lens: list[int]
    seq_lens: list[int]
    num_heads: int
    num_kv_heads: int
    block_size: int
    num_blocks: int
    block_order: str  # "shuffled" | "reversed" | "sequential"
    seed: int


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Oracle in float64: ``q [n, Hq, D]`` are the last ``n`` of ``L`` positions; ``k, v [L, Hkv, D]``."""
    n, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = torch.arange(ctx - n, ctx)[:, None]
    key_pos = torch.arange(ctx)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(
    case: Case,
    dtype: torch.dtype = torch.float32,
    backend: AttentionBackend | None = None,
    head_dim: int = HEAD_DIM,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``backend`` (the torch reference by default) on ``case``; return (output, oracle output, kv_cache after)."""
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    bs = case.block_size
    blocks = list(range(case.num_blocks))
    if case.block_order == "shuffled":
        rng.shuffle(blocks)
    elif case.block_order == "reversed":
        blocks.reverse()
    tables: list[list[int]] = []
    for s in case.seq_lens:
        need = -(-s // bs)
        tables.append(blocks[:need])
        blocks = blocks[need:]
    # Never-written slots hold NaN: any read of one that leaks into the result shows.
    kv_cache = torch.full((2, case.num_blocks, bs, case.num_kv_heads, head_dim), float("nan"), dtype=dtype)
    queries, keys, values, oracles = [], [], [], []
    scale = head_dim**-0.5
    for q_len, seq_len, table in zip(case.query_lens, case.seq_lens, tables, strict=True):
        k_all = torch.randn(seq_len, case.num_kv_heads, head_dim, generator=gen).to(dtype)
        v_all = torch.randn(seq_len, case.num_kv_heads, head_dim, generator=gen).to(dtype)
        q = torch.randn(q_len, case.num_heads, head_dim, generator=gen).to(dtype)
        for pos in range(seq_len - q_len):  # the cached context, written by earlier steps
            kv_cache[0, table[pos // bs], pos % bs] = k_all[pos]
            kv_cache[1, table[pos // bs], pos % bs] = v_all[pos]
        queries.append(q)
        keys.append(k_all[seq_len - q_len :])
        values.append(v_all[seq_len - q_len :])
        oracles.append(dense_attention(q, k_all, v_all, scale))
    meta = AttentionMetadata.build(case.query_lens, case.seq_lens, tables, bs)
    backend = backend or TorchPagedAttention()
    out = backend.forward(torch.cat(queries), torch.cat(keys), torch.cat(values), kv_cache, meta, scale)
    return out, torch.cat(oracles), kv_cache


def check(case: Case) -> None:
    out, oracle, kv_cache = run_case(case)
    assert out.shape == oracle.shape
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), oracle, atol=1e-5, rtol=0)


# --- fixed cases -----------------------------------------------------------


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (8, 2)])  # GQA groups 1, 3, 4
@pytest.mark.parametrize("block_order", ["shuffled", "reversed"])
def test_mixed_batch_decodes_chunks_and_prefills(num_heads: int, num_kv_heads: int, block_order: str) -> None:
    # decode (mid-block), chunk with cached context, full prefill, decode on a block edge,
    # a full prefill ending mid-block, a one-token prompt.
    check(Case([1, 5, 9, 1, 13, 1], [21, 12, 9, 16, 13, 1], num_heads, num_kv_heads, 4, 40, block_order, seed=1))


@pytest.mark.parametrize("num_heads, num_kv_heads", [(3, 3), (9, 3), (8, 2)])
@pytest.mark.parametrize("block_order", ["shuffled", "reversed", "sequential"])
def test_pure_decode_batch(num_heads: int, num_kv_heads: int, block_order: str) -> None:
    seq_lens = [1, 7, 16, 17, 33, 5]
    check(Case([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, 8, 20, block_order, seed=2))


def test_single_full_prefill_is_causal() -> None:
    check(Case([30], [30], 4, 2, 16, 4, "reversed", seed=3))


def test_chunk_after_cached_context() -> None:
    check(Case([7], [40], 4, 1, 16, 5, "shuffled", seed=4))


def test_decodes_not_first_in_mixed_batch() -> None:
    # Decode rows scattered between prefill chunks take the indexed (non-contiguous) path.
    check(Case([3, 1, 4, 1, 1], [10, 9, 4, 30, 2], 4, 2, 4, 30, "shuffled", seed=5))


def test_new_kv_lands_in_its_slots() -> None:
    case = Case([1, 6], [6, 6], 2, 2, 4, 8, "reversed", seed=6)
    _, _, kv_cache = run_case(case)
    meta_tables = [[7, 6], [5, 4]]  # reversed order: seq 0 gets 7, 6; seq 1 gets 5, 4
    # seq 0 wrote position 5 only: block 6 offset 1; seq 1 wrote positions 0..5.
    assert not kv_cache[:, 6, 1].isnan().any()
    assert kv_cache[:, 6, 2:].isnan().all()
    assert not kv_cache[:, meta_tables[1][0]].isnan().any()
    assert not kv_cache[:, meta_tables[1][1], :2].isnan().any()
    assert kv_cache[:, meta_tables[1][1], 2:].isnan().all()


def test_bfloat16_cache_and_query() -> None:
    case = Case([1, 4, 1], [9, 4, 17], 4, 2, 4, 12, "shuffled", seed=7)
    out, oracle, _ = run_case(case, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), oracle, atol=3e-2, rtol=0)


def test_rejects_heads_not_a_multiple_of_kv_heads() -> None:
    meta = AttentionMetadata.build([1], [1], [[0]], 4)
    kv = torch.zeros(2, 1, 4, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="multiple"):
        TorchPagedAttention().forward(
            torch.zeros(1, 3, HEAD_DIM), torch.zeros(1, 2, HEAD_DIM), torch.zeros(1, 2, HEAD_DIM), kv, meta, 1.0
        )


# --- random shapes -----------------------------------------------------------


@st.composite
def cases(draw: st.DrawFn) -> Case:
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_seqs = draw(st.integers(1, 5))
    seq_lens = draw(st.lists(st.integers(1, 40), min_size=num_seqs, max_size=num_seqs))
    kind = draw(st.sampled_from(["decode", "mixed"]))
    if kind == "decode":
        query_lens = [1] * num_seqs
    else:
        query_lens = [draw(st.integers(1, s)) for s in seq_lens]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + draw(st.integers(0, 3))
    order = draw(st.sampled_from(["shuffled", "reversed", "sequential"]))
    return Case(
        query_lens,
        seq_lens,
        num_kv_heads * group,
        num_kv_heads,
        block_size,
        num_blocks,
        order,
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=60, deadline=None, derandomize=True)
@given(cases())
def test_random_batches_match_dense_oracle(case: Case) -> None:
    check(case)
