"""Paged decode attention: one query token per sequence, split-K over the context.

Flash-decoding in two kernels (the shape of SGLang's / lightllm's
``decode_attention`` stage 1 + stage 2)::

    context of seq b:  |-- split 0 --|-- split 1 --| ... |-- split S-1 --|
    stage 1, program (b, kv_head, s):  online softmax over split s for every
        query head of the GQA group -> partial out o_s, log2-sum-exp lse_s
    stage 2, program (b, q_head):  out = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m),
        m = max_s lse_s (empty splits skipped)

Split ``s`` of sequence ``b`` covers positions ``[s * L, min((s+1) * L, seq_len))``
with ``L = ceil(ceil(seq_len / S) / BLOCK_N) * BLOCK_N``, so a short sequence in
a batch sized for a long one simply leaves its tail splits empty.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .dot import dot_flags, tile_dot
from .kv_quant import kernel_view, load_rows, quant_mode

# Split heuristic: aim for enough programs to fill an H100/H200-class GPU
# (~132 SMs, several programs each) without splits shorter than a few tiles.
_TARGET_PROGRAMS = 1024
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64
_BLOCK_N = 64
_MIN_BLOCK_H = 16  # tl.dot needs M >= 16


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_split_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    qk_scale,
    num_splits,
    stride_q_seq,
    stride_q_head,
    stride_q_dim,
    stride_c_kv,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    stride_c_dim,
    stride_bt_seq,
    stride_bt_idx,
    stride_mo_seq,
    stride_mo_head,
    stride_mo_split,
    stride_ml_seq,
    stride_ml_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_len(seq_len, num_splits, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start >= end:
        return  # stage 2 skips this split by the same arithmetic

    hh = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + hh
    mask_h = hh < GROUP
    dims = tl.arange(0, BLOCK_D)
    mask_d = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :] * stride_q_dim,
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )

    k_base = cache_ptr + kv_head * stride_c_head
    v_base = k_base + stride_c_kv
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        mask_n = pos < end
        block_ids = tl.load(table + (pos // BLOCK_SIZE) * stride_bt_idx, mask=mask_n, other=0)
        tok_off = block_ids.to(tl.int64) * stride_c_block + (pos % BLOCK_SIZE) * stride_c_off
        k = load_rows(k_base, tok_off, dims, mask_n, mask_d, stride_c_dim, HEAD_DIM, QUANT, q.dtype)
        v = load_rows(v_base, tok_off, dims, mask_n, mask_d, stride_c_dim, HEAD_DIM, QUANT, q.dtype)

        qk = tile_dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    mo = mid_o_ptr + seq * stride_mo_seq + heads[:, None] * stride_mo_head + split * stride_mo_split + dims[None, :]
    tl.store(mo, acc / l_i[:, None], mask=mask_h[:, None] & mask_d[None, :])
    ml = mid_lse_ptr + seq * stride_ml_seq + heads * stride_ml_head + split
    tl.store(ml, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    num_splits,
    stride_mo_seq,
    stride_mo_head,
    stride_mo_split,
    stride_ml_seq,
    stride_ml_head,
    stride_o_seq,
    stride_o_head,
    stride_o_dim,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)

    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_len(seq_len, num_splits, BLOCK_N)
    splits = tl.arange(0, BLOCK_S)
    mask_s = (splits < num_splits) & (splits * split_len < seq_len)
    dims = tl.arange(0, BLOCK_D)
    mask_d = dims < HEAD_DIM

    lse = tl.load(
        mid_lse_ptr + seq * stride_ml_seq + head * stride_ml_head + splits,
        mask=mask_s,
        other=float("-inf"),
    )
    o = tl.load(
        mid_o_ptr + seq * stride_mo_seq + head * stride_mo_head + splits[:, None] * stride_mo_split + dims[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    # Split 0 is never empty (seq_len >= 1), so m is finite.
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + seq * stride_o_seq + head * stride_o_head + dims * stride_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """How many context partitions to compute in parallel per (sequence, kv head).

    Enough that ``num_seqs * num_kv_heads * splits`` approaches
    ``_TARGET_PROGRAMS``, but no split shorter than ``_MIN_TOKENS_PER_SPLIT``
    tokens and at most ``_MAX_SPLITS``.
    """
    by_length = math.ceil(max(max_seq_len, 1) / _MIN_TOKENS_PER_SPLIT)
    by_occupancy = math.ceil(_TARGET_PROGRAMS / max(num_seqs * num_kv_heads, 1))
    return max(1, min(by_length, by_occupancy, _MAX_SPLITS))


def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attend one query token per sequence to its whole cached context.

    The query token's own K/V must already be in the cache (see ``store_kv``).

    Args:
        query: ``[B, num_heads, head_dim]`` fp16/bf16/fp32, any strides.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``,
            same dtype as ``query``; or int8 / fp8 ``[..., head_dim + 4]`` rows
            (codes, then a float32 scale; :mod:`streamkv.attention.kv_layout`),
            dequantized to ``query``'s dtype as each tile is loaded.
        block_tables: int32 ``[B, max_blocks_per_seq]`` physical block ids.
        seq_lens: int32 ``[B]`` context length per sequence (>= 1), including
            the query token.
        scale: softmax scale applied to ``q . k``.
        max_seq_len: host-side upper bound of ``seq_lens`` (sizes the splits
            without a device sync).
        num_splits: context partitions per sequence; ``None`` picks
            :func:`default_num_splits`.

    Returns:
        ``[B, num_heads, head_dim]`` in ``query``'s dtype. GQA: query head
        ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

    Raises:
        ValueError: on shape or dtype mismatches.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_row = kv_cache.shape
    mode = quant_mode(kv_cache)
    cache_head_dim = cache_row - 4 if mode else cache_row
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"query {tuple(query.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    if not mode and kv_cache.dtype != query.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} != query dtype {query.dtype}")
    if block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError("block_tables / seq_lens do not have one row per query")
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_seq_len)

    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    # Partial outputs are fp32 with a dense last dim (the kernels index it unit-stride).
    mid_o = torch.empty((num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=query.device)
    mid_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)

    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        kernel_view(kv_cache),
        block_tables,
        seq_lens,
        mid_o,
        mid_lse,
        scale * math.log2(math.e),
        num_splits,
        *query.stride(),
        *kv_cache.stride(),
        *block_tables.stride(),
        *mid_o.stride()[:3],
        *mid_lse.stride()[:2],
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=max(_MIN_BLOCK_H, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=_BLOCK_N,
        **dot_flags(query.dtype),
        QUANT=mode,
        num_warps=4,
    )
    _decode_merge_kernel[(num_seqs, num_heads)](
        mid_o,
        mid_lse,
        seq_lens,
        out,
        num_splits,
        *mid_o.stride()[:3],
        *mid_lse.stride()[:2],
        *out.stride(),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=_BLOCK_N,
        BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4,
    )
    return out
