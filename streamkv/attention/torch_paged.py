"""Reference paged attention in plain torch: runs on any device, fast enough on a CPU.

Two paths share one write::

    kv_cache[2, num_blocks, block_size, Hkv, D]
        .view(2, num_blocks * block_size, Hkv, D)      # slot-addressed, no copy
        .index_copy_(1, slot_mapping, new K / V)       # this step's tokens

    decode rows (query_len == 1), all at once:
        slots[b, c] = block_tables[b, c // bs] * bs + c % bs     c < max_ctx
        K, V        = gathered head-major                        [B * Hkv, max_ctx, D]
        out         = softmax(q [B * Hkv, G, D] @ K^T * scale + mask(c < seq_len)) @ V

    prefill / chunk rows (query_len > 1), one sequence at a time:
        K, V  = the sequence's context gathered from its block table  [L, Hkv, D]
        out   = SDPA(q, K, V, causal with offset L - query_len)

A quantized cache (int8 / fp8 rows with a per-row scale, see
:mod:`streamkv.attention.kv_layout`) is dequantized to the query dtype as it
is gathered; a prefill with no cached context attends to its own K/V rounded
as the cache stores it, so every path sees the same values.

A mixed batch (decodes plus chunks, what chunked prefill schedules every
step) takes the batched path for its decode rows and loops only over the
chunks, so the Python loop never grows with the number of decodes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streamkv.attention.backend import AttentionBackend
from streamkv.attention.kv_layout import as_stored, gather_rows, gather_slots, write_kv
from streamkv.attention.metadata import AttentionMetadata


class TorchPagedAttention(AttentionBackend):
    """Paged attention with torch ops only (the reference every backend is tested against)."""

    name = "torch"

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
            query: ``[T, Hq, D]``; any strides.
            key, value: ``[T, Hkv, D]``; any strides.
            kv_cache: contiguous ``[2, num_blocks, block_size, Hkv, row]``, written in place;
                ``row`` is ``D``, or ``D + 4`` for int8 / fp8 rows with their scale
                (:mod:`streamkv.attention.kv_layout`).
            meta: the step's metadata; ``slot_mapping`` has ``T`` entries.
            scale: softmax scale.

        Returns:
            ``[T, Hq, D]`` in ``query``'s dtype, contiguous.
        """
        num_heads, head_dim = query.shape[1:]
        num_kv_heads = key.shape[1]
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        self.write(kv_cache, meta, key, value)

        if meta.is_pure_decode:
            return self.decode(
                query, kv_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, meta, scale, "decode"
            )

        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        if meta.decode_seqs:
            self._decode_subset(out, query, kv_cache, meta, meta.decode_seqs, scale)
        self.prefill(out, query, key, value, kv_cache, meta, scale)
        return out

    def write(self, kv_cache: torch.Tensor, meta: AttentionMetadata, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write this step's ``key`` / ``value`` ``[T, Hkv, D]`` into ``kv_cache`` at ``meta.slot_mapping``.

        Subclasses replace this (the C++ CPU backend), as they do :meth:`decode` and :meth:`prefill`.
        """
        write_kv(kv_cache, meta.slot_mapping, key, value)

    def prefill(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> None:
        """Causal attention of every sequence with ``query_len > 1`` to its context, into its rows of ``out``.

        Subclasses replace this (the C++ CPU backend), as they do :meth:`decode`; K/V are already written.

        Args:
            out: ``[T, Hq, D]``; the rows of decode sequences are left as they are.
            query: ``[T, Hq, D]``; key, value: ``[T, Hkv, D]`` (this step's, for a chunk with no context).
            kv_cache: contiguous ``[2, num_blocks, block_size, Hkv, row]``.
        """
        starts = meta.query_start_loc_cpu
        for i in range(meta.num_seqs):
            start, end = starts[i], starts[i + 1]
            if end - start == 1:
                continue
            seq_len = meta.seq_lens_cpu[i]
            if seq_len == end - start:
                # Nothing cached before this chunk: its own K/V is the whole context, as the
                # cache would return it (so a prefix hit or a chunk boundary changes nothing).
                k, v = as_stored(kv_cache, key[start:end]), as_stored(kv_cache, value[start:end])
            else:
                slots = _context_slots(meta.block_tables[i], seq_len, meta.block_size)
                k, v = gather_slots(kv_cache, slots, query.dtype)
            out[start:end] = _prefill(query[start:end], k.to(query.dtype), v.to(query.dtype), scale)

    def decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        meta: AttentionMetadata,
        scale: float,
        cache_key: str,
    ) -> torch.Tensor:
        """Attention of one query token per sequence to its whole cached context (K/V already written).

        Subclasses replace this (the C++ CPU backend); the prefill path stays shared.

        Args:
            query: ``[B, Hq, D]``, unit last stride; row ``b`` belongs to sequence ``b``.
            kv_cache: contiguous ``[2, num_blocks, block_size, Hkv, D]``.
            block_tables: int32 ``[B, max_blocks]``.
            seq_lens: int32 ``[B]``, each in ``1..max_seq_len``.
            max_seq_len: the largest ``seq_lens`` entry (a host int: no sync).
            meta: the step's metadata (its ``step_cache`` and ``block_size``).
            scale: softmax scale.
            cache_key: names this call's per-step scratch in ``meta.step_cache``.

        Returns:
            ``[B, Hq, D]`` in ``query``'s dtype, contiguous.
        """
        return _decode(
            query, kv_cache, block_tables, seq_lens, max_seq_len, meta.block_size, scale, meta.step_cache, cache_key
        )

    def _decode_subset(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        seqs: list[int],
        scale: float,
    ) -> None:
        """Batched decode for the one-token sequences ``seqs`` of a mixed batch, into ``out``.

        Args:
            out: ``[T, Hq, D]``, rows of ``seqs`` overwritten.
            query: ``[T, Hq, D]``.
            seqs: indices of sequences whose query length is 1, ascending.
        """
        starts = meta.query_start_loc_cpu
        rows = [starts[i] for i in seqs]
        max_seq_len = max(meta.seq_lens_cpu[i] for i in seqs)
        if seqs[-1] - seqs[0] == len(seqs) - 1:
            # The scheduler puts decodes first: a contiguous run needs no index tensors.
            r, s = slice(rows[0], rows[-1] + 1), slice(seqs[0], seqs[-1] + 1)
            out[r] = self.decode(
                query[r], kv_cache, meta.block_tables[s], meta.seq_lens[s], max_seq_len, meta, scale, "decode_subset"
            )
            return
        row_idx = torch.tensor(rows, device=query.device)
        seq_idx = torch.tensor(seqs, device=query.device)
        out[row_idx] = self.decode(
            query.index_select(0, row_idx),
            kv_cache,
            meta.block_tables.index_select(0, seq_idx),
            meta.seq_lens.index_select(0, seq_idx),
            max_seq_len,
            meta,
            scale,
            "decode_subset",
        )


# --- helpers -------------------------------------------------------------


def _decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    block_size: int,
    scale: float,
    step_cache: dict[str, object] | None = None,
    cache_key: str = "",
) -> torch.Tensor:
    """One query token per sequence, every sequence in one gather and two batched matmuls.

    The gather reads the pool head-major, so each (sequence, KV head) pair gets
    a contiguous ``[max_ctx, D]`` matrix and the query group of that head a
    ``[G, D]`` one: ``scores = q @ K^T`` is one ``bmm`` over ``B * Hkv`` pairs
    (faster on CPU than SDPA for a handful of query rows per head).

    Args:
        query: ``[B, Hq, D]``, row ``b`` belongs to sequence ``b``.
        kv_cache: contiguous ``[2, num_blocks, block_size, Hkv, row]`` (see
            :mod:`streamkv.attention.kv_layout`; quantized rows are dequantized
            to ``query``'s dtype as they are gathered).
        block_tables: int ``[B, max_blocks]``.
        seq_lens: int ``[B]``, each in ``1..max_seq_len``.
        max_seq_len: the largest entry of ``seq_lens`` (a host int: no sync).
        step_cache, cache_key: where the gather rows and the mask bias, the
            same for every layer of a step, are kept after the first layer.

    Returns:
        ``[B, Hq, D]`` contiguous.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    cached = step_cache.get(cache_key) if step_cache is not None else None
    if cached is None:
        rows, bias = _decode_indices(block_tables, seq_lens, max_seq_len, block_size, num_kv_heads, query.dtype)
        if step_cache is not None:
            step_cache[cache_key] = (rows, bias)
    else:
        rows, bias = cached  # type: ignore[misc]
    kv = gather_rows(kv_cache, rows, query.dtype).view(2, num_seqs * num_kv_heads, max_seq_len, head_dim)
    q = query.reshape(num_seqs * num_kv_heads, group, head_dim)  # a query group shares its KV head
    scores = torch.baddbmm(bias, q, kv[0].transpose(1, 2), alpha=scale)  # [B * Hkv, G, max_ctx]
    probs = scores.softmax(-1, dtype=torch.float32).to(query.dtype)
    return torch.bmm(probs, kv[1]).view(num_seqs, num_heads, head_dim)


def _decode_indices(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    block_size: int,
    num_kv_heads: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather rows ``[B * Hkv * max_ctx]`` and additive mask ``[B * Hkv, 1, max_ctx]`` for :func:`_decode`."""
    num_seqs = block_tables.shape[0]
    device = block_tables.device
    ctx = torch.arange(max_seq_len, device=device)
    valid = ctx < seq_lens[:, None]  # [B, max_ctx]
    # Positions past a sequence's end read its position 0 (written, finite) and are masked:
    # stale or never-written slots could hold NaN, and 0 * NaN would leak through softmax.
    pos = torch.where(valid, ctx, 0)
    slots = _slots(block_tables, pos, block_size)  # [B, max_ctx]
    # Row (slot * Hkv + h) of the [num_slots * Hkv, D] view holds head h of a slot.
    rows = slots[:, None, :] * num_kv_heads + torch.arange(num_kv_heads, device=device)[:, None]
    bias = torch.where(valid, 0.0, float("-inf")).to(dtype)  # [B, max_ctx]
    bias = bias[:, None, None, :].expand(num_seqs, num_kv_heads, 1, max_seq_len).reshape(-1, 1, max_seq_len)
    return rows.view(-1), bias


def _slots(block_tables: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 ``[B, n]`` slots of positions ``pos [B, n]`` through ``block_tables [B, max_blocks]``."""
    if block_size & (block_size - 1) == 0:  # powers of two (the cache config's rule): shifts, no division
        shift = block_size.bit_length() - 1
        return (block_tables.gather(1, pos >> shift).long() << shift) | (pos & (block_size - 1))
    return block_tables.gather(1, pos // block_size).long() * block_size + pos % block_size


def _context_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Slots of positions ``0 .. seq_len-1`` of one sequence.

    Args:
        block_table: int ``[max_blocks]``, the sequence's row of ``block_tables``.

    Returns:
        int64 ``[seq_len]``.
    """
    num_blocks = -(-seq_len // block_size)
    offsets = torch.arange(block_size, device=block_table.device)
    slots = block_table[:num_blocks].long()[:, None] * block_size + offsets
    return slots.view(-1)[:seq_len]


def _prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a chunk's queries to its whole context.

    Query ``j`` sits at position ``L - q + j`` and sees positions ``0 ..= L - q + j``
    (the causal mask aligned to the bottom right).

    Args:
        query: ``[q, Hq, D]``, the last ``q`` positions of the context.
        key, value: ``[L, Hkv, D]``, positions ``0 .. L-1``, ``L >= q``.

    Returns:
        ``[q, Hq, D]``.
    """
    q_len, num_heads, head_dim = query.shape
    ctx_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    # GQA as [Hkv, G] "batch x heads" with K/V expanded (stride 0, no copy): SDPA's
    # enable_gqa=True falls back to the slow math kernel on the CPU, this keeps flash.
    q = query.transpose(0, 1).unflatten(0, (num_kv_heads, group))  # [Hkv, G, q, D]
    k = key.transpose(0, 1)[:, None].expand(num_kv_heads, group, ctx_len, head_dim)
    v = value.transpose(0, 1)[:, None].expand(num_kv_heads, group, ctx_len, head_dim)
    if q_len == ctx_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        mask = torch.ones(q_len, ctx_len, dtype=torch.bool, device=query.device).tril_(ctx_len - q_len)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.flatten(0, 1).transpose(0, 1)  # [q, Hq, D]
