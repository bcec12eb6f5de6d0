"""Random paged-attention scenarios and the dense oracle the kernels answer to.

The oracle gathers each sequence's K/V from its blocks into a contiguous
tensor and runs ``torch.nn.functional.scaled_dot_product_attention`` in fp64
with the causal offset mask (query ``j`` of a ``q``-token chunk over ``s``
positions sees ``0 ..= s - q + j``) and GQA by ``repeat_interleave``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from streamkv.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class PagedCase:
    """One step's worth of paged attention inputs.

    Attributes:
        query: ``[T, num_heads, head_dim]`` queries of the new tokens (flat).
        key, value: ``[T, num_kv_heads, head_dim]`` the new tokens' K/V.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``;
            unused slots hold NaN so a stray read poisons the output.
        query_lens, seq_lens, block_tables: host lists as in
            :meth:`AttentionMetadata.build`.
        block_size: tokens per block.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    block_size: int

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata.build(
            self.query_lens, self.seq_lens, self.block_tables, self.block_size, device=self.query.device
        )


def make_case(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    layout: str = "permuted",
    store_new: bool = True,
    strided_query: bool = False,
    seed: int = 0,
) -> PagedCase:
    """Random K/V for every position, laid out in scattered blocks.

    Args:
        layout: ``"permuted"`` hands out a random permutation of block ids;
            ``"reversed"`` gives each sequence descending block ids.
        store_new: also write the new tokens' K/V into the cache (what the
            attention kernels expect); ``False`` leaves it to ``store_kv``.
        strided_query: carve ``query`` out of a wider fused-QKV-like tensor so
            its token stride is not ``num_heads * head_dim``.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    if layout == "permuted":
        ids = torch.randperm(num_blocks, generator=gen).tolist()
    elif layout == "reversed":
        ids = list(range(num_blocks - 1, -1, -1))
    else:
        raise ValueError(f"unknown layout {layout!r}")
    tables: list[list[int]] = []
    for n in blocks_per_seq:
        tables.append(ids[:n])
        ids = ids[n:]

    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    flat = cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    new_k, new_v = [], []
    for q, s, table in zip(query_lens, seq_lens, tables, strict=True):
        kv = torch.randn((2, s, num_kv_heads, head_dim), generator=gen).to(dtype)
        pos = torch.arange(s)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        upto = s if store_new else s - q
        flat[:, slots[:upto]] = kv[:, :upto]
        new_k.append(kv[0, s - q :])
        new_v.append(kv[1, s - q :])

    num_tokens = sum(query_lens)
    width = num_heads + 2 * num_kv_heads if strided_query else num_heads
    query = torch.randn((num_tokens, width, head_dim), generator=gen).to(dtype)[:, :num_heads]
    return PagedCase(
        query=query.to(device),
        key=torch.cat(new_k).to(device),
        value=torch.cat(new_v).to(device),
        kv_cache=cache.to(device),
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        block_tables=tables,
        block_size=block_size,
    )


def dense_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: list[list[int]],
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """fp64 ``[T, num_heads, head_dim]`` reference for the paged kernels."""
    num_heads = query.shape[1]
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    group = num_heads // num_kv_heads
    outs = []
    start = 0
    for q_len, s, table in zip(query_lens, seq_lens, block_tables, strict=True):
        blocks = kv_cache[:, torch.tensor(table, device=kv_cache.device)]
        kv = blocks.reshape(2, -1, num_kv_heads, head_dim)[:, :s].double()
        k = kv[0].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, s, D]
        v = kv[1].repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[start : start + q_len].double().transpose(0, 1)  # [Hq, q, D]
        q_pos = s - q_len + torch.arange(q_len, device=query.device)
        mask = torch.arange(s, device=query.device)[None, :] <= q_pos[:, None]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1))
        start += q_len
    return torch.cat(outs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: atol = rtol = 1e-5; fp16 / bf16: atol 2e-2, rtol 1e-2."""
    tight = actual.dtype == torch.float32
    torch.testing.assert_close(
        actual.double(),
        expected.double(),
        atol=1e-5 if tight else 2e-2,
        rtol=1e-5 if tight else 1e-2,
    )
