"""Triton kernels for paged attention over the block-structured KV cache.

Importing this package imports ``triton``; the engine reaches it only through
:mod:`streamkv.attention.triton_paged`, so machines without triton still load
``streamkv.attention``.

KV cache of one layer: ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 keys, 1 values); token slot ``= block_id * block_size + offset``.
"""

from __future__ import annotations

from .paged_decode import paged_decode
from .paged_prefill import paged_prefill
from .store_kv import store_kv

__all__ = ["paged_decode", "paged_prefill", "store_kv"]
