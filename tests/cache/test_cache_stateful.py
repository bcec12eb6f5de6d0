"""Random operation sequences against KVCacheManager, checked against a shadow model.

The shadow holds what the model would have written into every slot: the KV at
position ``p`` of a sequence is a function of its tokens ``[0, p]``, so a slot
holds the key ``tuple(token_ids[: p + 1])``. The test writes keys when it
"computes" tokens (through the block table), applies the cache manager's
copy-on-write copies and swap mappings in the runner's order (swap-out,
swap-in, copies, forward), and after every step asserts that each computed
token of each sequence, session pin and swapped sequence reads back its own
key, and that every cached block holds exactly the prefix its hash names.

A tiny vocabulary (0..3) makes prefixes collide, so hits, shared blocks and
duplicate (private) full blocks are common.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from block_state_oracle import expected_block_state
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from streamkv.cache.block import KVBlock
from streamkv.cache.hashing import BlockHash, hash_block_tokens
from streamkv.cache.kv_cache_manager import KVCacheManager, cdiv

VOCAB = st.integers(0, 3)
SESSION_IDS = st.sampled_from(["a", "b", "c"])
PICK = st.integers(-2, 2) | st.integers(0, 10**6)  # an index modulo the choices: -1 is the newest
CHUNK = st.integers(1, 12)
EXTRA_KEY = b"tiny-model"

Key = tuple[int, ...]  # the prefix whose KV a slot holds


@dataclass
class Seq:
    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int = 0


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.bs = 1
        self.running: dict[int, Seq] = {}  # hold device blocks
        self.swapped: dict[int, Seq] = {}  # hold host blocks
        self.waiting: dict[int, Seq] = {}  # preempted by recompute, hold nothing
        self.pins: OrderedDict[str, list[int]] = OrderedDict()  # session -> pinned tokens, LRU first
        self.dev: list[list[Key | None]] = []  # block id -> slot keys
        self.host_mem: list[list[Key | None]] = []
        self.next_id = 0
        self.num_preempted = 0  # in the current step
        self._hash_memo: dict[Key, BlockHash | None] = {(): None}

    # ------------------------------------------------------------- helpers

    @property
    def cache(self) -> KVCacheManager:
        assert self.kv is not None
        return self.kv

    def new_seq(self, token_ids: list[int]) -> Seq:
        self.next_id += 1
        return Seq(self.next_id, token_ids)

    @staticmethod
    def pick(seqs: dict[int, Seq], i: int) -> Seq:
        return seqs[sorted(seqs)[i % len(seqs)]]

    def chain_hash(self, key: Key) -> BlockHash | None:
        """The hash of the last full block of ``key`` (a whole number of blocks)."""
        if key not in self._hash_memo:
            parent = self.chain_hash(key[: -self.bs])
            self._hash_memo[key] = hash_block_tokens(parent, key[-self.bs :], EXTRA_KEY)
        return self._hash_memo[key]

    def need(self, seq: Seq, n: int, hits: list[KVBlock]) -> tuple[int, bool]:
        """Free blocks allocate_slots needs, from the spec: new + copy-on-write + revived hits."""
        table = self.cache.seq_blocks.get(seq.seq_id, [])
        c = seq.num_computed_tokens + len(hits) * self.bs
        new = max(0, cdiv(c + n, self.bs) - len(table) - len(hits))
        w = c // self.bs
        cow = n > 0 and w < len(table) and table[w].ref_cnt > 1
        revived = sum(1 for b in hits if b.ref_cnt == 0)
        return new + int(cow) + revived, cow

    def snapshot(self) -> object:
        kv = self.cache
        pool = kv.pool
        return (
            [(b.ref_cnt, b.pin_cnt, b.block_hash, b.token_ids) for b in pool.blocks],
            [b.block_id for b in pool.free_queue],
            {h: b.block_id for h, b in pool.cached.items()},
            {s: [b.block_id for b in blocks] for s, blocks in kv.seq_blocks.items()},
            {s: list(h) for s, h in kv.swapped.items()},
            {s: [b.block_id for b in p.blocks] for s, p in kv.sessions.items()},
            bytes(pool.states),
            (pool.counters.cow_copies, pool.counters.evictions, kv.host.num_free_blocks, kv.num_pinned_blocks),
        )

    def try_allocate(self, seq: Seq, n: int, hits: Sequence[KVBlock] = ()) -> tuple[bool, bool]:
        """allocate_slots, checked against the spec; all or nothing on failure."""
        kv = self.cache
        need, cow = self.need(seq, n, list(hits))
        free = kv.pool.num_free_blocks
        before = self.snapshot()
        ok = kv.allocate_slots(seq, n, hits)
        assert ok == (need <= free), (need, free)
        if not ok:
            assert self.snapshot() == before, "a refused allocation changed state"
        return ok, cow

    def write(self, seq: Seq, n: int) -> None:
        """The forward: write ``n`` tokens' KV after the computed ones, then commit."""
        bs = self.bs
        table = self.cache.block_table(seq.seq_id)
        c = seq.num_computed_tokens
        assert len(table) * bs >= c + n, "allocate_slots gave too few slots"
        for p in range(c, c + n):
            self.dev[table[p // bs]][p % bs] = tuple(seq.token_ids[: p + 1])
        seq.num_computed_tokens += n
        self.cache.commit(seq)

    def apply_copies(self, copies: list[tuple[int, int]], expected: list[tuple[int, int]]) -> None:
        assert sorted(copies) == sorted(expected)
        dsts = [d for _, d in copies]
        assert len(set(dsts)) == len(dsts), f"two copies into one block: {copies}"
        data = [list(self.dev[s]) for s, _ in copies]  # a batched copy reads every source first
        for (_, d), slots in zip(copies, data, strict=True):
            self.dev[d] = slots

    def sample(self, seq: Seq, token: int) -> None:
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(token)

    def admit(self, seq: Seq, chunk: int, unpin_on_fail: bool, token: int) -> bool:
        """A new (or requeued) sequence: prefix lookup, allocate, compute a chunk."""
        kv = self.cache
        bs = self.bs
        hits = kv.get_computed_blocks(seq)
        max_hits = (len(seq.token_ids) - 1) // bs
        assert len(hits) <= max_hits
        for i, b in enumerate(hits):
            assert b.block_hash is not None and b.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs])
        if kv.enable_prefix_caching and len(hits) < max_hits:  # the chain is the longest one
            miss = tuple(seq.token_ids[: (len(hits) + 1) * bs])
            assert all(self.dev[b.block_id][bs - 1] != miss for b in kv.pool.cached.values())
        num_hit_tokens = len(hits) * bs
        n = min(chunk, len(seq.token_ids) - num_hit_tokens)
        while True:
            ok, cow = self.try_allocate(seq, n, hits)
            assert not cow
            if ok:
                break
            if not (unpin_on_fail and kv.unpin_lru()):
                return False
            self.pins.popitem(last=False)
        kv.record_prefix_query(len(seq.token_ids), num_hit_tokens)
        seq.num_computed_tokens += num_hit_tokens
        self.running[seq.seq_id] = seq
        self.apply_copies(kv.take_copies(), [])
        self.write(seq, n)
        self.sample(seq, token)
        return True

    def check_swap_mapping(
        self, seq: Seq, table: list[int], mapping: list[tuple[int, int]], host_free: set[int], cow_src: dict[int, int]
    ) -> None:
        """Swap-outs run before this step's COW copies: a block copied this step maps from its source."""
        k = cdiv(seq.num_computed_tokens, self.bs)
        assert [d for d, _ in mapping] == [cow_src.get(b, b) for b in table[:k]]
        host_ids = [h for _, h in mapping]
        assert len(set(host_ids)) == k and set(host_ids) <= host_free
        assert self.cache.swapped[seq.seq_id] == host_ids

    def host_free_ids(self) -> set[int]:
        used = {h for ids in self.cache.swapped.values() for h in ids}
        return set(range(self.cache.host.num_blocks)) - used

    # -------------------------------------------------------------- rules

    @initialize(
        bs=st.sampled_from([1, 2, 4, 4]),
        num_blocks=st.integers(2, 32),
        num_host_blocks=st.integers(0, 12),
        max_pinned_blocks=st.integers(0, 16),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, bs: int, num_blocks: int, num_host_blocks: int, max_pinned_blocks: int, caching: bool) -> None:
        self.bs = bs
        self.kv = KVCacheManager(
            num_blocks,
            bs,
            enable_prefix_caching=caching,
            extra_key=EXTRA_KEY,
            max_pinned_blocks=max_pinned_blocks,
            num_host_blocks=num_host_blocks,
        )
        self.dev = [[None] * bs for _ in range(num_blocks)]
        self.host_mem = [[None] * bs for _ in range(self.kv.host.num_blocks)]

    @rule(prompt=st.lists(VOCAB, min_size=1, max_size=14), chunk=CHUNK, unpin=st.booleans(), token=VOCAB)
    def new_sequence(self, prompt: list[int], chunk: int, unpin: bool, token: int) -> None:
        seq = self.new_seq(prompt)
        if not self.admit(seq, chunk, unpin, token):
            self.cache.free(seq.seq_id)  # never admitted: drop it

    @precondition(lambda self: self.waiting)
    @rule(i=PICK, chunk=CHUNK, unpin=st.booleans(), token=VOCAB)
    def readmit(self, i: int, chunk: int, unpin: bool, token: int) -> None:
        seq = self.pick(self.waiting, i)
        assert seq.num_computed_tokens == 0 and not self.cache.has_blocks(seq.seq_id)
        if self.admit(seq, chunk, unpin, token):
            del self.waiting[seq.seq_id]

    @precondition(lambda self: self.running)
    @rule(
        picks=st.lists(PICK, min_size=1, max_size=4),
        chunks=st.lists(CHUNK, min_size=4, max_size=4),
        tokens=st.lists(VOCAB, min_size=4, max_size=4),
        preempt=st.sampled_from(["none", "swap", "recompute"]),
        force=st.none() | PICK,
        resume=st.none() | PICK,
    )
    def step(
        self,
        picks: list[int],
        chunks: list[int],
        tokens: list[int],
        preempt: str,
        force: int | None,
        resume: int | None,
    ) -> None:
        """One scheduler step: allocate for a batch (preempting the newest on failure), then forward."""
        kv = self.cache
        batch = list(dict.fromkeys(self.pick(self.running, i).seq_id for i in picks))
        self.num_preempted = 0
        chosen: dict[int, int] = {}
        cows: dict[int, tuple[int, int]] = {}  # seq id -> (src, dst) copied on write this step
        swap_outs: list[tuple[int, int]] = []
        for k, seq_id in enumerate(batch):
            if seq_id not in self.running:
                continue  # preempted earlier in this step
            seq = self.running[seq_id]
            n = min(chunks[k], len(seq.token_ids) - seq.num_computed_tokens)
            assert n >= 1
            while True:
                w = seq.num_computed_tokens // self.bs
                old_table = kv.block_table(seq_id)
                ok, cow = self.try_allocate(seq, n)
                if ok:
                    chosen[seq_id] = n
                    if cow:
                        cows[seq_id] = (old_table[w], kv.block_table(seq_id)[w])
                    break
                if preempt == "none":
                    break
                if kv.unpin_lru():
                    self.pins.popitem(last=False)
                    continue
                victim = self.running[max(self.running)]  # the most recent arrival
                self.preempt(victim, preempt, swap_outs, chosen, cows)
                if victim is seq:
                    break
        if force is not None and self.running:  # preempted after allocating, before the forward
            self.preempt(self.pick(self.running, force), preempt, swap_outs, chosen, cows)
        swap_ins: list[tuple[int, int]] = []
        if resume is not None and self.swapped and not self.num_preempted:
            # like the scheduler: swap in only in a step that preempted nobody
            seq = self.pick(self.swapped, resume)
            mapping = kv.swap_in(seq)
            if mapping is not None:
                swap_ins = mapping
                del self.swapped[seq.seq_id]
                self.running[seq.seq_id] = seq
        # the runner: swap-out copies, swap-in copies, copy-on-write copies, then the forward
        for d, h in swap_outs:
            self.host_mem[h] = list(self.dev[d])
        for h, d in swap_ins:
            self.dev[d] = list(self.host_mem[h])
        self.apply_copies(kv.take_copies(), [cows[s] for s in chosen if s in cows])
        for k, seq_id in enumerate(batch):
            if seq_id in chosen:
                seq = self.running[seq_id]
                self.write(seq, chosen[seq_id])
                self.sample(seq, tokens[k])

    def preempt(
        self,
        seq: Seq,
        mode: str,
        swap_outs: list[tuple[int, int]],
        chosen: dict[int, int],
        cows: dict[int, tuple[int, int]],
    ) -> None:
        kv = self.cache
        self.num_preempted += 1
        del self.running[seq.seq_id]
        chosen.pop(seq.seq_id, None)
        if mode == "swap" and seq.num_computed_tokens and kv.can_swap_out(seq.seq_id):
            table = kv.block_table(seq.seq_id)
            host_free = self.host_free_ids()
            mapping = kv.swap_out(seq)
            cow_src = {dst: src for src, dst in cows.values()}
            self.check_swap_mapping(seq, table, mapping, host_free, cow_src)
            swap_outs.extend(mapping)
            self.swapped[seq.seq_id] = seq
        else:
            kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            self.waiting[seq.seq_id] = seq

    @precondition(lambda self: self.running)
    @rule(i=PICK, samples=st.lists(st.none() | VOCAB, min_size=1, max_size=3))
    def fork(self, i: int, samples: list[int | None]) -> None:
        """Parallel sampling: children share every block; each may sample its own last token."""
        parent = self.pick(self.running, i)
        for token in samples:
            child = self.new_seq(list(parent.token_ids))
            child.num_computed_tokens = parent.num_computed_tokens
            if token is not None and child.num_computed_tokens == len(child.token_ids) - 1:
                child.token_ids[-1] = token
            self.cache.fork(parent, child)
            self.running[child.seq_id] = child

    @precondition(lambda self: self.running or self.swapped or self.waiting)
    @rule(i=PICK)
    def free(self, i: int) -> None:
        seqs = {**self.running, **self.swapped, **self.waiting}
        seq = self.pick(seqs, i)
        self.cache.free(seq.seq_id)
        for group in (self.running, self.swapped, self.waiting):
            group.pop(seq.seq_id, None)

    @precondition(lambda self: self.running)
    @rule(i=PICK, sid=SESSION_IDS)
    def pin(self, i: int, sid: str) -> None:
        """A turn ends: its blocks move to the session."""
        kv = self.cache
        seq = self.pick(self.running, i)
        c = seq.num_computed_tokens
        keep = cdiv(c, self.bs)
        self.pins.pop(sid, None)
        expect = 0 < keep <= kv.max_pinned_blocks
        if expect:
            while self.pins and sum(cdiv(len(t), self.bs) for t in self.pins.values()) + keep > kv.max_pinned_blocks:
                self.pins.popitem(last=False)
            self.pins[sid] = list(seq.token_ids[:c])
        assert kv.pin_session(sid, seq) == expect
        assert not kv.has_blocks(seq.seq_id)
        kv.free(seq.seq_id)
        del self.running[seq.seq_id]

    @precondition(lambda self: self.pins)
    @rule(
        i=PICK,
        extension=st.lists(VOCAB, max_size=6),
        mismatch=st.none() | PICK,
        chunk=CHUNK,
        token=VOCAB,
    )
    def adopt(self, i: int, extension: list[int], mismatch: int | None, chunk: int, token: int) -> None:
        """The next turn of a pinned session: history + new tokens."""
        kv = self.cache
        sid = sorted(self.pins)[i % len(self.pins)]
        history = self.pins.pop(sid)
        prompt = history + extension
        if mismatch is not None:
            j = mismatch % len(history)
            prompt[j] = (prompt[j] + 1) % 4
        seq = self.new_seq(prompt)
        # the longest common prefix, short of the prompt's last token, never
        # ending inside a cached full block (adopt_session's contract)
        limit = min(len(history), len(prompt) - 1)
        expect = next((j for j in range(limit) if prompt[j] != history[j]), limit)
        pin_blocks = kv.sessions[sid].blocks
        if expect % self.bs and pin_blocks[expect // self.bs].block_hash is not None:
            expect -= expect % self.bs
        n = kv.adopt_session(sid, seq)
        assert n == expect
        assert sid not in kv.sessions
        if n:
            seq.num_computed_tokens = n
            self.running[seq.seq_id] = seq
        elif not self.admit(seq, chunk, False, token):
            kv.free(seq.seq_id)

    @rule(sid=SESSION_IDS)
    def release(self, sid: str) -> None:
        assert self.cache.release_session(sid) == (sid in self.pins)
        self.pins.pop(sid, None)

    @rule()
    def unpin_lru(self) -> None:
        assert self.cache.unpin_lru() == bool(self.pins)
        if self.pins:
            self.pins.popitem(last=False)

    @rule(pattern=st.lists(VOCAB, min_size=1, max_size=6), keep=st.booleans(), unpin=st.booleans())
    def evict_pressure(self, pattern: list[int], keep: bool, unpin: bool) -> None:
        """A filler sequence takes one block at a time until allocate_slots says no."""
        kv = self.cache
        bs = self.bs
        filler = self.new_seq([])
        for _ in range(kv.pool.num_blocks + 20):
            while len(filler.token_ids) < filler.num_computed_tokens + bs + 1:
                filler.token_ids.append(pattern[len(filler.token_ids) % len(pattern)])
            ok, cow = self.try_allocate(filler, bs)
            assert not cow
            if not ok:
                if unpin and kv.unpin_lru():
                    self.pins.popitem(last=False)
                    continue
                break
            self.running[filler.seq_id] = filler
            self.apply_copies(kv.take_copies(), [])
            self.write(filler, bs)
        else:
            raise AssertionError("the pool never ran dry")
        assert kv.pool.num_free_blocks == 0  # it needed exactly one block and got none
        assert kv.pool.state_counts()["cached"] == 0
        if unpin:
            assert not kv.sessions
        if not keep or filler.seq_id not in self.running:
            kv.free(filler.seq_id)
            self.running.pop(filler.seq_id, None)

    @precondition(lambda self: self.running)
    @rule(i=PICK)
    def swap_out(self, i: int) -> None:
        kv = self.cache
        seq = self.pick(self.running, i)
        table = kv.block_table(seq.seq_id)
        host_free = self.host_free_ids()
        can = kv.can_swap_out(seq.seq_id)
        assert can == (len(table) <= len(host_free))
        if not can:
            before = self.snapshot()
            with pytest.raises(ValueError):
                kv.swap_out(seq)
            assert self.snapshot() == before, "a refused swap-out changed state"
            return
        mapping = kv.swap_out(seq)
        self.check_swap_mapping(seq, table, mapping, host_free, {})
        for d, h in mapping:
            self.host_mem[h] = list(self.dev[d])
        del self.running[seq.seq_id]
        self.swapped[seq.seq_id] = seq

    @precondition(lambda self: self.swapped)
    @rule(i=PICK)
    def swap_in(self, i: int) -> None:
        kv = self.cache
        seq = self.pick(self.swapped, i)
        host_ids = list(kv.swapped[seq.seq_id])
        fits = len(host_ids) <= kv.pool.num_free_blocks
        before = self.snapshot()
        mapping = kv.swap_in(seq)
        if not fits:
            assert mapping is None
            assert self.snapshot() == before, "a refused swap-in changed state"
            return
        assert mapping is not None
        assert [h for h, _ in mapping] == host_ids
        assert kv.block_table(seq.seq_id) == [d for _, d in mapping]
        for h, d in mapping:
            self.dev[d] = list(self.host_mem[h])
        del self.swapped[seq.seq_id]
        self.running[seq.seq_id] = seq

    # ---------------------------------------------------------- invariants

    def check_slots(self, slots_of: list[list[Key | None]], ids: list[int], token_ids: list[int], n: int) -> None:
        bs = self.bs
        assert len(ids) == cdiv(n, bs), (len(ids), n)
        for p in range(n):
            assert slots_of[ids[p // bs]][p % bs] == tuple(token_ids[: p + 1]), f"wrong KV at position {p}"

    @invariant()
    def consistent(self) -> None:
        if self.kv is None:
            return
        kv = self.kv
        pool = kv.pool
        bs = self.bs
        kv.check_invariants()
        assert set(kv.seq_blocks) == set(self.running)
        assert set(kv.swapped) == set(self.swapped)
        assert list(kv.sessions) == list(self.pins)
        holders: Counter[int] = Counter()
        pinners: Counter[int] = Counter()
        for seq in self.running.values():
            table = kv.block_table(seq.seq_id)
            assert len(set(table)) == len(table)
            assert seq.num_computed_tokens < len(seq.token_ids)
            self.check_slots(self.dev, table, seq.token_ids, seq.num_computed_tokens)
            holders.update(table)
        for sid, tokens in self.pins.items():
            pin = kv.sessions[sid]
            assert pin.token_ids == tokens
            ids = [b.block_id for b in pin.blocks]
            self.check_slots(self.dev, ids, tokens, len(tokens))
            holders.update(ids)
            pinners.update(ids)
        host_used: list[int] = []
        for seq in self.swapped.values():
            host_ids = kv.swapped[seq.seq_id]
            self.check_slots(self.host_mem, host_ids, seq.token_ids, seq.num_computed_tokens)
            host_used += host_ids
        assert len(set(host_used)) == len(host_used) == kv.host.num_used_blocks
        indexed = {b.block_id for b in pool.cached.values()}
        for b in pool.blocks:
            assert b.ref_cnt == holders[b.block_id], f"block {b.block_id}: ref_cnt {b.ref_cnt}"
            assert b.pin_cnt == pinners[b.block_id]
            # the state from this machine's own holder counts, not from the block's fields
            want = expected_block_state(holders[b.block_id], pinners[b.block_id], b.block_id in indexed)
            assert pool.states[b.block_id] == want, f"block {b.block_id}: state {pool.states[b.block_id]}, want {want}"
        assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)
        assert kv.num_pinned_blocks == sum(pinners.values())
        counts = pool.state_counts()
        assert sum(counts.values()) == pool.num_blocks
        assert counts["cached"] == sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        if not kv.enable_prefix_caching:
            assert not pool.cached
        for block_hash, b in pool.cached.items():
            slots = self.dev[b.block_id]
            key = slots[bs - 1]
            assert key is not None and len(key) % bs == 0, f"cached block {b.block_id} is not a full block"
            for j in range(bs):
                assert slots[j] == key[: len(key) - bs + j + 1], f"cached block {b.block_id} slot {j} is stale"
            assert b.token_ids == key[-bs:]
            assert self.chain_hash(key) == block_hash, f"cached block {b.block_id} is indexed under another prefix"

    def teardown(self) -> None:
        if self.kv is None:
            return
        kv = self.kv
        for seq_id in [*self.running, *self.swapped, *self.waiting]:
            kv.free(seq_id)
        while kv.unpin_lru():
            pass
        kv.check_invariants()
        assert kv.pool.num_free_blocks == kv.pool.num_blocks
        assert kv.host.num_free_blocks == kv.host.num_blocks
        assert not kv.sessions and not kv.seq_blocks and not kv.swapped and kv.num_pinned_blocks == 0


CacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCacheStateful = CacheMachine.TestCase
