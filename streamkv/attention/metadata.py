"""Attention metadata: the one record that crosses from the runner into attention.

Layout of a step's flat batch (``T`` tokens from ``B`` sequences)::

    flat tokens:  | seq 0 chunk | seq 1 chunk | ... | seq B-1 chunk |
    query_start_loc: 0 ---------- q1 ---------- q2 ... ------------ T

Sequence ``i`` contributes ``query_len_i = query_start_loc[i+1] - query_start_loc[i]``
new tokens. ``seq_lens[i]`` is its context length *after* this step (cached
tokens plus the new ones), so its ``j``-th new token sits at position
``seq_lens[i] - query_len_i + j`` and attends to positions ``0 ..= that``
(the cached context through the block table, causally within the chunk).

KV cache of one layer: ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 keys, 1 values). Token at position ``p`` of sequence ``i`` lives in
block ``block_tables[i, p // block_size]`` at offset ``p % block_size``; its
slot is ``block_id * block_size + offset`` (vLLM's slot mapping).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step paged attention metadata (all tensors on the model's device).

    Attributes:
        query_start_loc: int32 ``[B+1]`` cumulative query lengths, starts at 0.
        seq_lens: int32 ``[B]`` context length per sequence after this step.
        block_tables: int32 ``[B, max_blocks_per_seq]`` physical block ids,
            padded with 0 past each sequence's last block (never read).
        slot_mapping: int64 ``[T]`` slot to write each new token's K/V to.
        max_query_len: largest query length in the batch.
        max_seq_len: largest ``seq_lens`` entry.
        query_start_loc_cpu: host copy of ``query_start_loc`` (python ints).
        seq_lens_cpu: host copy of ``seq_lens`` (python ints).
        block_size: tokens per KV block.
        step_cache: per-step scratch for backends: index and mask tensors that
            depend only on this metadata are built by the first layer and
            reused by the others (every layer sees the same batch).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    step_cache: dict[str, object] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_seqs(self) -> list[int]:
        """Indices of the sequences with one query token (a mixed batch's decode rows), ascending.

        Computed by the first layer that asks and kept in ``step_cache``: every layer sees the same batch.
        """
        seqs = self.step_cache.get("decode_seqs")
        if seqs is None:
            starts = self.query_start_loc_cpu
            seqs = self.step_cache["decode_seqs"] = [i for i in range(self.num_seqs) if starts[i + 1] - starts[i] == 1]
        return cast("list[int]", seqs)

    @property
    def is_pure_decode(self) -> bool:
        """True when every sequence contributes exactly one query token."""
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata from host lists (the runner and tests share this).

        Args:
            query_lens: new tokens per sequence this step (each >= 1).
            seq_lens: context length per sequence after this step.
            block_tables: physical block ids per sequence, each covering at
                least ``ceil(seq_len / block_size)`` blocks.
            block_size: tokens per block.
            device: where the tensors go.

        Raises:
            ValueError: on mismatched lengths, a query longer than its
                context, or a block table too short for its context.
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables differ in length")
        starts = [0]
        slots: list[int] = []
        for q, s, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if q < 1 or q > s:
                raise ValueError(f"query length {q} must be in 1..seq_len ({s})")
            if len(table) * block_size < s:
                raise ValueError(f"block table of {len(table)} blocks too short for {s} tokens")
            starts.append(starts[-1] + q)
            for pos in range(s - q, s):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), width),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=starts,
            seq_lens_cpu=list(seq_lens),
            block_size=block_size,
        )

    def last_rows(self, seqs: list[int]) -> OutputRows:
        """The last row of each sequence in ``seqs`` (ascending indices into this batch), as :class:`OutputRows`."""
        rows = [self.query_start_loc_cpu[i + 1] - 1 for i in seqs]
        if not seqs:
            return OutputRows(torch.empty(0, dtype=torch.int64, device=self.seq_lens.device), None)
        device = self.seq_lens.device
        index = torch.tensor(seqs, dtype=torch.int64, device=device)
        indices = torch.tensor(rows, dtype=torch.int64, device=device)
        seq_lens_cpu = [self.seq_lens_cpu[i] for i in seqs]
        meta = AttentionMetadata(
            query_start_loc=torch.arange(len(seqs) + 1, dtype=torch.int32, device=device),
            seq_lens=self.seq_lens.index_select(0, index),
            block_tables=self.block_tables.index_select(0, index),
            slot_mapping=self.slot_mapping.index_select(0, indices),
            max_query_len=1,
            max_seq_len=max(seq_lens_cpu),
            query_start_loc_cpu=list(range(len(seqs) + 1)),
            seq_lens_cpu=seq_lens_cpu,
            block_size=self.block_size,
        )
        return OutputRows(indices, meta)


@dataclass(frozen=True, slots=True)
class OutputRows:
    """The rows of a step whose final hidden states are used (the rows that sample), and their decode metadata.

    Only these rows need the last decoder layer past its K/V write: the model
    runs that layer's attention, o_proj and MLP on them alone (the other rows'
    outputs would feed nothing), each row attending as one query to its whole
    context, as a decode row does.

    Attributes:
        indices: int64 ``[N]`` row indices into the step's flat batch, ascending.
        meta: the metadata of those ``N`` rows as a pure-decode batch (``None`` when ``N == 0``).
    """

    indices: torch.Tensor
    meta: AttentionMetadata | None

    @property
    def num_rows(self) -> int:
        return int(self.indices.shape[0])

