"""KV cache manager: which blocks each sequence and session holds.

The scheduler asks three questions (vLLM v1's narrow seam):
``get_computed_blocks`` (prefix cache hits for a new sequence),
``allocate_slots`` (room for this step's tokens, or ``False``: preempt
someone) and ``free``. Around them: ``fork`` for parallel sampling with
copy-on-write, session pins (a finished chat turn keeps its blocks so the
next turn computes only its new tokens) and swap to a host tier.

Block index arithmetic for a sequence with ``num_computed_tokens = c`` that
computes ``k`` new tokens this step (block size ``bs``)::

    tokens:  [0 ........ c) [c ...... c+k)
    blocks:  0 .. c//bs        .. ceil((c+k)/bs) - 1
                    ^ the block holding position c is written: if it is
                      shared (ref_cnt > 1) it is copied first (COW)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from streamkv.cache.block import CacheSeq, KVBlock, cdiv
from streamkv.cache.block_pool import BlockPool
from streamkv.cache.cache_stats import KVCacheStats, OffloadStats
from streamkv.cache.hashing import BlockHash, hash_block_tokens
from streamkv.cache.host_offload import HostOffloadMixin
from streamkv.cache.host_tier import HostTier
from streamkv.cache.session_pins import SessionPins
from streamkv.cache.swap_space import SwapSpace

__all__ = ["CacheSeq", "KVCacheManager", "cdiv"]


class KVCacheManager(HostOffloadMixin):
    """Blocks per sequence and per session over one :class:`BlockPool`.

    Args:
        num_blocks: device pool size.
        block_size: tokens per block.
        enable_prefix_caching: hash full blocks and reuse them across requests.
        extra_key: bytes folded into every block hash (model identity).
        max_pinned_blocks: most blocks idle sessions may pin together.
        num_host_blocks: swap tier size (capped at ``num_blocks`` without ``offload_sessions``).
        offload_sessions: a pin that gives way moves to the host tier
            (:mod:`streamkv.cache.host_tier`) instead of being dropped.
        spill_to_disk: sessions evicted from a full host tier become spill
            jobs for the disk tier instead of being dropped.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        extra_key: bytes = b"",
        max_pinned_blocks: int | None = None,
        num_host_blocks: int = 0,
        offload_sessions: bool = False,
        spill_to_disk: bool = False,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_key = extra_key
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        # preempted sequences alone never need more host blocks than the pool has;
        # offloaded idle sessions do (the host tier is where most of them live)
        self.host = SwapSpace(num_host_blocks if offload_sessions else min(num_host_blocks, num_blocks))
        self.seq_blocks: dict[int, list[KVBlock]] = {}
        self.swapped: dict[int, list[int]] = {}  # seq id -> host block ids
        self.sessions = SessionPins(self.pool, num_blocks if max_pinned_blocks is None else max_pinned_blocks)
        self.num_swapped_out_blocks = 0  # monotonic
        self.offload_sessions = offload_sessions
        self.host_sessions = HostTier(self.host, spill_to_disk)
        # host <-> device copies of the step being scheduled, in the order they were decided
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._hashes: dict[int, list[BlockHash]] = {}
        self._num_committed: dict[int, int] = {}
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def max_pinned_blocks(self) -> int:
        """Most blocks idle sessions may pin together."""
        return self.sessions.max_pinned_blocks

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks pinned by idle sessions now."""
        return self.sessions.num_pinned_blocks

    # ----------------------------------------------------------- sequences

    def block_table(self, seq_id: int) -> list[int]:
        """Physical block ids of a sequence, in logical order."""
        return [b.block_id for b in self.seq_blocks.get(seq_id, ())]

    def has_blocks(self, seq_id: int) -> bool:
        return seq_id in self.seq_blocks

    def get_computed_blocks(self, seq: CacheSeq) -> list[KVBlock]:
        """Longest chain of cached full blocks that prefixes ``seq.token_ids``.

        Capped so that at least the last token is computed (its logits are
        needed). Takes no reference and counts nothing: pass the result to
        :meth:`allocate_slots`, then :meth:`record_prefix_query` once admitted.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        num_tokens = len(seq.token_ids)
        max_blocks = (num_tokens - 1) // bs
        hashes = self._block_hashes(seq, max_blocks)
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = self.pool.lookup(hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup: ``num_tokens`` queried, ``num_hit_tokens`` found (cache or pin)."""
        self.pool.counters.prefix_cache_queries += num_tokens
        self.pool.counters.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        seq: CacheSeq,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
        num_reserved_blocks: int = 0,
    ) -> bool:
        """Give ``seq`` slots for ``num_new_tokens`` tokens after its computed ones.

        ``computed_blocks`` (prefix hits of a sequence holding no blocks yet)
        are referenced first and count as computed: the caller then adds
        ``len(computed_blocks) * block_size`` to ``num_computed_tokens``.
        ``num_reserved_blocks`` free blocks must stay free afterwards (the
        scheduler's reservations for other sequences).
        All or nothing: returns ``False`` and changes nothing when the pool
        cannot provide the blocks (the scheduler then preempts).
        """
        blocks = self.seq_blocks.get(seq.seq_id, [])
        if computed_blocks and blocks:
            raise ValueError("prefix hits are only for a sequence without blocks")
        bs = self.block_size
        num_computed = seq.num_computed_tokens + len(computed_blocks) * bs
        num_required = cdiv(num_computed + num_new_tokens, bs)
        have = len(blocks) + len(computed_blocks)
        num_new_blocks = max(0, num_required - have)
        write_idx = num_computed // bs
        cow = write_idx < len(blocks) and blocks[write_idx].ref_cnt > 1 and num_new_tokens > 0
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + int(cow) + revived > self.pool.num_free_blocks - num_reserved_blocks:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks = list(computed_blocks)
        if cow:
            self._copy_on_write(blocks, write_idx)
        if num_new_blocks:
            blocks.extend(self.pool.allocate(num_new_blocks))
        self.seq_blocks[seq.seq_id] = blocks
        return True

    def num_missing_blocks(self, seq: CacheSeq, num_tokens: int) -> int:
        """Free blocks ``seq`` still needs to hold ``num_tokens`` tokens.

        Counts the blocks it lacks, plus one when the block it writes next is
        shared (copy-on-write takes a fresh block for it).
        """
        blocks = self.seq_blocks.get(seq.seq_id, [])
        missing = max(0, cdiv(num_tokens, self.block_size) - len(blocks))
        write_idx = seq.num_computed_tokens // self.block_size
        if write_idx < len(blocks) and blocks[write_idx].ref_cnt > 1:
            missing += 1
        return missing

    def commit(self, seq: CacheSeq) -> None:
        """Register the sequence's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        blocks = self.seq_blocks.get(seq.seq_id)
        if not blocks:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(blocks))
        start = self._num_committed.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs]))
        self._num_committed[seq.seq_id] = num_full

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (tail first) and any host blocks."""
        blocks = self.seq_blocks.pop(seq_id, None)
        if blocks:
            self._free_blocks(reversed(blocks))
        host = self.swapped.pop(seq_id, None)
        if host:
            self.host.free(host)
        self._hashes.pop(seq_id, None)
        self._num_committed.pop(seq_id, None)

    def fork(self, parent: CacheSeq, child: CacheSeq) -> None:
        """Let ``child`` share every block of ``parent`` (copy-on-write later)."""
        blocks = self.seq_blocks[parent.seq_id]
        self.pool.touch(blocks)
        self.seq_blocks[child.seq_id] = list(blocks)
        if parent.seq_id in self._hashes:
            self._hashes[child.seq_id] = list(self._hashes[parent.seq_id])
        self._num_committed[child.seq_id] = self._num_committed.get(parent.seq_id, 0)

    def take_copies(self) -> list[tuple[int, int]]:
        """COW block copies ``(src, dst)`` made since the last call; the runner applies them.

        A copy whose destination was freed before this call (its sequence was
        preempted in the same step) is dropped: the block may already serve
        another sequence, and two copies into one block race.
        """
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ------------------------------------------------------------- sessions

    def pin_session(self, session_id: str, seq: CacheSeq) -> bool:
        """Move a finished turn's references to its session.

        Keeps the blocks holding the sequence's computed tokens (the partial
        last block too); frees the rest. Unpins least recently active
        sessions to stay under ``max_pinned_blocks``; when the turn alone is
        too big it frees everything instead and returns ``False``.
        """
        self.release_session(session_id)
        blocks = self.seq_blocks.pop(seq.seq_id, [])
        self._hashes.pop(seq.seq_id, None)
        self._num_committed.pop(seq.seq_id, None)
        num_keep = cdiv(seq.num_computed_tokens, self.block_size)
        if len(blocks) > num_keep:
            self._free_blocks(reversed(blocks[num_keep:]))
        keep = blocks[:num_keep]
        if not keep or len(keep) > self.max_pinned_blocks:
            self._free_blocks(reversed(keep))
            return False
        while not self.sessions.fits(len(keep)) and self.unpin_lru():
            pass
        n = seq.num_computed_tokens
        self.sessions.add(session_id, keep, list(seq.token_ids[:n]), list(seq.token_ids[n:]))
        return True

    def adopt_session(self, session_id: str, seq: CacheSeq) -> int:
        """Continue a session's pinned blocks in a new sequence of that session.

        Reuses what :meth:`SessionPin.num_reusable_tokens` finds; blocks past
        it are freed. Returns the number of tokens now computed for ``seq``
        (0: nothing reusable, the pin is released); the caller sets
        ``num_computed_tokens`` to it.
        """
        pin = self.sessions.get(session_id)
        if pin is None:
            return 0
        n = pin.num_reusable_tokens(seq.token_ids, self.block_size)
        if n == 0 or seq.seq_id in self.seq_blocks:
            self.release_session(session_id)
            return 0
        self.sessions.remove(session_id)
        keep = cdiv(n, self.block_size)
        self._free_blocks(reversed(pin.blocks[keep:]))
        self.seq_blocks[seq.seq_id] = pin.blocks[:keep]
        return n

    def release_session(self, session_id: str) -> bool:
        """Drop a session's pin (its full blocks stay in the prefix cache) and its host copy."""
        dropped = self.host_sessions.drop(session_id)
        pin = self.sessions.remove(session_id)
        if pin is None:
            return dropped
        self._free_blocks(reversed(pin.blocks))
        return True

    def unpin_lru(self) -> bool:
        """Make the least recently active pin give way; ``False`` if there is none.

        With ``offload_sessions`` its blocks are copied to the host tier
        first (evicting least recently used host sessions to disk or
        dropping them for room); when the host tier cannot hold it, it is
        dropped as without offload. Either way its device references go.
        """
        session_id = self.sessions.least_recently_active()
        if session_id is None:
            return False
        if self.offload_sessions:
            self._offload(session_id)
        pin = self.sessions.remove(session_id)
        assert pin is not None
        self._free_blocks(reversed(pin.blocks))
        return True

    # ----------------------------------------------------------------- swap

    def can_swap_out(self, seq_id: int) -> bool:
        return len(self.seq_blocks.get(seq_id, ())) <= self.host.num_free_blocks

    def swap_out(self, seq: CacheSeq) -> list[tuple[int, int]]:
        """Move a sequence's computed blocks to the host tier.

        Returns ``(device_block, host_block)`` copies for the runner, to be
        applied before this step's forward and before its copy-on-write
        copies (the runner's order): a block copied on write earlier in this
        step is still empty then, so its copy reads from the COW source.
        Device references are dropped.

        Raises:
            ValueError: the host tier lacks room (check :meth:`can_swap_out`).
        """
        blocks = self.seq_blocks[seq.seq_id]
        keep = blocks[: cdiv(seq.num_computed_tokens, self.block_size)]
        host_ids = self.host.allocate(len(keep))  # raises before anything changes
        del self.seq_blocks[seq.seq_id]
        self.swapped[seq.seq_id] = host_ids
        cow_src = {dst: src for src, dst in self._pending_copies}
        mapping = [(cow_src.get(b.block_id, b.block_id), h) for b, h in zip(keep, host_ids, strict=True)]
        self._free_blocks(reversed(blocks))
        self._num_committed.pop(seq.seq_id, None)
        self.num_swapped_out_blocks += len(keep)
        self._swap_out.extend(mapping)
        return mapping

    def swap_in(self, seq: CacheSeq) -> list[tuple[int, int]] | None:
        """Bring a swapped sequence back; ``(host_block, device_block)`` copies or ``None`` if no room."""
        host_ids = self.swapped[seq.seq_id]
        if len(host_ids) > self.pool.num_free_blocks:
            return None
        blocks = self.pool.allocate(len(host_ids))
        del self.swapped[seq.seq_id]
        self._release_swap_in_source(host_ids)
        self.seq_blocks[seq.seq_id] = blocks
        mapping = [(h, b.block_id) for h, b in zip(host_ids, blocks, strict=True)]
        self._swap_in.extend(mapping)
        return mapping

    # ----------------------------------------------------------- accounting

    def held_references(self) -> dict[int, int]:
        """Block id -> references held by sequences and pins (for invariant checks)."""
        refs: dict[int, int] = {}
        for blocks in self.seq_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for pin in self.sessions.values():
            for b in pin.blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        return refs

    def check_invariants(self) -> None:
        """Pool consistency plus: ref counts equal the references held here."""
        self.pool.check_invariants(self.held_references())
        self.sessions.check_invariants()
        for pin in self.sessions.values():
            assert len(pin.blocks) == cdiv(len(pin.token_ids), self.block_size)
        self.host_sessions.check_invariants()
        held = sum(len(h) for h in self.swapped.values()) + self.host_sessions.num_blocks
        assert self.host.num_used_blocks == held + self.host.num_quarantined_blocks

    # ------------------------------------------------------------ internals

    def _block_hashes(self, seq: CacheSeq, num_blocks: int) -> list[BlockHash]:
        hashes = self._hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, seq.token_ids[i * bs : (i + 1) * bs], self.extra_key))
        return hashes

    def _free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, and pending copies into blocks now free."""
        self.pool.free(blocks)
        if self._pending_copies:
            refs = self.pool.blocks
            self._pending_copies = [(s, d) for s, d in self._pending_copies if refs[d].ref_cnt > 0]

    def _copy_on_write(self, blocks: list[KVBlock], idx: int) -> None:
        old = blocks[idx]
        (new,) = self.pool.allocate(1)
        self._pending_copies.append((old.block_id, new.block_id))
        self.pool.free([old])
        blocks[idx] = new
        self.pool.counters.cow_copies += 1

    # ------------------------------------------------ queries and stats (issue #10)
    # The scheduler and the stats snapshot ask these instead of reading the
    # pool and the swap map directly.

    @property
    def num_free_blocks(self) -> int:
        """Device blocks that can be allocated now (free, cached ones included)."""
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        """Device blocks in the pool."""
        return len(self.pool.blocks)

    def num_swapped_blocks(self, seq_id: int) -> int:
        """Blocks a swapped-out sequence holds on the host tier.

        Raises:
            KeyError: ``seq_id`` is not swapped out.
        """
        return len(self.swapped[seq_id])

    def stats(self, offload: OffloadStats | None = None) -> KVCacheStats:
        """A copy of the cache's state for the stats snapshot; call it on the owning thread.

        Costs one bytes copy of the per-block states; pins are shared, not
        copied: a :class:`SessionPin` is never changed after it is made (a new
        pin replaces it), so other threads may read its block ids.
        """
        pc = self.pool.counters
        return KVCacheStats(
            num_blocks=len(self.pool.blocks),
            block_size=self.block_size,
            states=bytes(self.pool.states),
            num_sessions=len(self.sessions),
            num_pinned_blocks=self.pool.num_pinned_blocks,  # distinct blocks: two pins may share one
            prefix_cache_queries=pc.prefix_cache_queries,
            prefix_cache_hits=pc.prefix_cache_hits,
            evictions=pc.evictions,
            cow_copies=pc.cow_copies,
            num_swapped_out_blocks=self.num_swapped_out_blocks,
            pins=tuple(self.sessions.values()),
            offload=offload if offload is not None else self.offload_stats(),
        )
