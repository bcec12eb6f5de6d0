"""Triton paged attention backend: an adapter over the kernels in ``streamkv/kernels/``.

Importing this module imports triton; ``streamkv.attention`` deliberately does
not, so the package loads on machines without it.
"""

from __future__ import annotations

import torch

from streamkv.attention.backend import AttentionBackend
from streamkv.attention.metadata import AttentionMetadata
from streamkv.kernels import paged_decode, paged_prefill, store_kv


class TritonPagedAttention(AttentionBackend):
    """Store the step's K/V, then run the decode kernel (split-K) on pure
    decode steps and the prefill/extend kernel on everything else."""

    name = "triton"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`.

        Args:
            query: ``[T, num_heads, head_dim]``.
            key, value: ``[T, num_kv_heads, head_dim]``.
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
                in ``query``'s dtype, written in place at ``meta.slot_mapping``.
            meta: step metadata; ``meta.block_size`` must match the cache.
            scale: softmax scale.

        Returns:
            ``[T, num_heads, head_dim]`` in ``query``'s dtype.

        Raises:
            ValueError: when ``meta.block_size`` disagrees with ``kv_cache``
                (or the kernels reject the shapes).
        """
        self.write(kv_cache, meta, key, value)
        if meta.is_pure_decode:
            return paged_decode(
                query,
                kv_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                max_seq_len=meta.max_seq_len,
            )
        return paged_prefill(
            query,
            kv_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            max_query_len=meta.max_query_len,
        )

    def write(self, kv_cache: torch.Tensor, meta: AttentionMetadata, key: torch.Tensor, value: torch.Tensor) -> None:
        """See :meth:`AttentionBackend.write` (the Triton store kernel).

        Raises:
            ValueError: when ``meta.block_size`` disagrees with ``kv_cache``.
        """
        if kv_cache.shape[2] != meta.block_size:
            raise ValueError(f"kv_cache block size {kv_cache.shape[2]} != meta.block_size {meta.block_size}")
        store_kv(key, value, kv_cache, meta.slot_mapping)

