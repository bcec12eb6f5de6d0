"""The interface every attention backend implements (torch reference, Triton)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from streamkv.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention over a flat token batch.

    One instance serves every layer; it holds no per-step state.
    """

    name: str

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V into the pool, then attend.

        Args:
            query: ``[T, num_heads, head_dim]``.
            key, value: ``[T, num_kv_heads, head_dim]`` for the new tokens.
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``,
                updated in place at ``meta.slot_mapping``.
            meta: see :class:`AttentionMetadata`.
            scale: softmax scale, usually ``head_dim ** -0.5``.

        Returns:
            ``[T, num_heads, head_dim]`` in ``query``'s dtype. GQA: query head
            ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
        """

    @abstractmethod
    def write(self, kv_cache: torch.Tensor, meta: AttentionMetadata, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write this step's ``key`` / ``value`` ``[T, num_kv_heads, head_dim]`` into ``kv_cache`` at
        ``meta.slot_mapping``, and nothing else (the first half of :meth:`forward`)."""

