"""Scatter a step's new keys and values into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import kernel_view, qmax, quant_mode, store_rows


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_k_dim,
    stride_v_tok,
    stride_v_head,
    stride_v_dim,
    stride_c_kv,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    stride_c_dim,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
):
    # One program per token: copies its [num_kv_heads, head_dim] key and value.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    k = tl.load(
        key_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :] * stride_k_dim,
        mask=mask,
    )
    v = tl.load(
        value_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :] * stride_v_dim,
        mask=mask,
    )
    dst = (
        cache_ptr
        + block_id * stride_c_block
        + offset * stride_c_off
        + heads[:, None] * stride_c_head
        + dims[None, :] * stride_c_dim
    )
    # A quantized row's scale sits right after its HEAD_DIM codes (stride_c_dim is 1 there).
    scale_ptr = cache_ptr + block_id * stride_c_block + offset * stride_c_off + heads * stride_c_head + HEAD_DIM
    mask_h = heads < NUM_KV_HEADS
    store_rows(dst, k.to(tl.float32), mask, scale_ptr, mask_h, QUANT, QMAX)
    store_rows(dst + stride_c_kv, v.to(tl.float32), mask, scale_ptr + stride_c_kv, mask_h, QUANT, QMAX)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each new token's key and value into its cache slot, in place.

    Args:
        key, value: ``[T, num_kv_heads, head_dim]``, any strides; cast to the
            cache dtype on store.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, row]``
            (0 keys, 1 values), any strides; ``row`` is ``head_dim``, or for
            int8 / fp8 caches ``head_dim + 4`` (codes, then the float32 scale
            of the row, :mod:`streamkv.attention.kv_layout`), unit last stride.
        slot_mapping: int64 ``[T]``, ``slot = block_id * block_size + offset``;
            every entry must be a valid slot (no padding sentinel).

    Raises:
        ValueError: on shape mismatches.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    mode = quant_mode(kv_cache)
    row = head_dim + (4 if mode else 0)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (num_kv_heads, row):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not fit key {tuple(key.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} != ({num_tokens},)")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kernel_view(kv_cache),
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *kv_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=mode,
        QMAX=qmax(mode),
    )
