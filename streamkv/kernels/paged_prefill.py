"""Paged prefill / extend attention: chunks of new tokens over a cached context.

Sequence ``i`` brings ``query_len_i`` new tokens on top of ``ctx_len_i =
seq_len_i - query_len_i`` cached ones; its new token ``j`` sits at position
``ctx_len_i + j`` and attends to positions ``0 ..= ctx_len_i + j``::

    positions:  0 ............ ctx_len-1 | ctx_len ........ seq_len-1
                  cached context (paged)  |  this chunk (already stored)
    query j:    sees everything here ---->|-- causal: <= ctx_len + j

Every K/V, the chunk's own included, is read from the paged cache, so
``store_kv`` must run first. Program ``(m, i, h)`` owns query rows
``[m * BLOCK_M, (m+1) * BLOCK_M)`` of sequence ``i`` for query head ``h`` and
runs an online softmax (FlashAttention-2) over ``[0, ctx_len + (m+1) * BLOCK_M)``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .dot import dot_flags, tile_dot
from .kv_quant import kernel_view, load_rows, quant_mode


@triton.jit
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_c_kv,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    stride_c_dim,
    stride_bt_seq,
    stride_bt_idx,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - query_len

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < query_len
    q_pos = ctx_len + rows
    dims = tl.arange(0, BLOCK_D)
    mask_d = dims < HEAD_DIM
    toks = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + toks[:, None] * stride_q_tok + head * stride_q_head + dims[None, :] * stride_q_dim,
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )

    k_base = cache_ptr + (head // GROUP) * stride_c_head
    v_base = k_base + stride_c_kv
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Rows past query_len have q_pos >= seq_len, so the seq_len bound keeps them finite.
    kv_end = tl.minimum(seq_len, ctx_len + (m_block + 1) * BLOCK_M)
    for tile in range(0, kv_end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        mask_n = pos < kv_end
        block_ids = tl.load(table + (pos // BLOCK_SIZE) * stride_bt_idx, mask=mask_n, other=0)
        tok_off = block_ids.to(tl.int64) * stride_c_block + (pos % BLOCK_SIZE) * stride_c_off
        k = load_rows(k_base, tok_off, dims, mask_n, mask_d, stride_c_dim, HEAD_DIM, QUANT, q.dtype)
        v = load_rows(v_base, tok_off, dims, mask_n, mask_d, stride_c_dim, HEAD_DIM, QUANT, q.dtype)

        qk = tile_dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
        visible = (pos[None, :] <= q_pos[:, None]) & mask_n[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        # Tile 0 always holds position 0, visible to every row: m_i is finite after it.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + toks[:, None] * stride_o_tok + head * stride_o_head + dims[None, :] * stride_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def _tile_sizes(dtype: torch.dtype, block_d: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 64x64 for 16-bit inputs, halved for fp32 / wide heads."""
    if dtype == torch.float32 or block_d > 128:
        return 32, 32
    return 64, 64


def paged_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """Causal attention of each sequence's new chunk over its paged context.

    The chunk's own K/V must already be in the cache (see ``store_kv``).
    Decode sequences (``query_len == 1``) are valid members of the batch.

    Args:
        query: ``[T, num_heads, head_dim]`` fp16/bf16/fp32, flat over the
            batch, any strides.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``,
            same dtype as ``query``; or int8 / fp8 ``[..., head_dim + 4]`` rows
            (codes, then a float32 scale; :mod:`streamkv.attention.kv_layout`),
            dequantized to ``query``'s dtype as each tile is loaded.
        block_tables: int32 ``[B, max_blocks_per_seq]`` physical block ids.
        query_start_loc: int32 ``[B+1]`` cumulative query lengths from 0.
        seq_lens: int32 ``[B]`` context length per sequence after this step.
        scale: softmax scale applied to ``q . k``.
        max_query_len: host-side largest query length (sizes the grid).

    Returns:
        ``[T, num_heads, head_dim]`` in ``query``'s dtype. GQA: query head
        ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

    Raises:
        ValueError: on shape or dtype mismatches.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_row = kv_cache.shape
    mode = quant_mode(kv_cache)
    cache_head_dim = cache_row - 4 if mode else cache_row
    num_seqs = seq_lens.shape[0]
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"query {tuple(query.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    if not mode and kv_cache.dtype != query.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} != query dtype {query.dtype}")
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError("query_start_loc / block_tables do not match seq_lens")
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    block_d = triton.next_power_of_2(head_dim)
    block_m, block_n = _tile_sizes(query.dtype, block_d)
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        query,
        kernel_view(kv_cache),
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * math.log2(math.e),
        *query.stride(),
        *kv_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        **dot_flags(query.dtype),
        QUANT=mode,
        num_warps=4,
    )
    return out
