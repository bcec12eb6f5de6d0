"""KVCacheManager scenarios: prefix hits, forks and copy-on-write, swap (session pins: test_session_pins.py)."""

from __future__ import annotations

import pytest
from cache_helpers import BS, Seq, admit, check, compute, decode, finish_turn, free_all, tokens

from streamkv.cache.block import BlockState
from streamkv.cache.kv_cache_manager import KVCacheManager

# --------------------------------------------------------- prefix caching


@pytest.mark.parametrize(
    ("num_tokens", "num_hit_tokens"), [(1, 0), (15, 0), (16, 0), (17, 16), (31, 16), (32, 16), (33, 32), (48, 32)]
)
@pytest.mark.parametrize("first_still_running", [True, False])
def test_second_identical_prompt_hits_whole_blocks_but_the_last_token(
    num_tokens: int, num_hit_tokens: int, first_still_running: bool
) -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = Seq(1, tokens(num_tokens))
    assert admit(kv, a) == 0
    blocks = kv.seq_blocks[1]
    assert [b.block_hash is not None for b in blocks] == [i < num_tokens // BS for i in range(len(blocks))]
    if not first_still_running:
        kv.free(1)
        check(kv)
    b = Seq(2, tokens(num_tokens))
    hits = kv.get_computed_blocks(b)
    assert len(hits) * BS == num_hit_tokens
    if first_still_running:
        assert [h.block_id for h in hits] == kv.block_table(1)[: len(hits)]
    assert admit(kv, b) == num_hit_tokens
    assert b.num_computed_tokens == num_tokens
    assert kv.block_table(2)[: len(hits)] == [h.block_id for h in hits]
    want_ref = 2 if first_still_running else 1
    assert all(h.ref_cnt == want_ref for h in hits)
    # the tail past the hits is private
    assert not set(kv.block_table(2)[len(hits) :]) & set(kv.block_table(1))
    assert kv.pool.counters.prefix_cache_queries == 2 * num_tokens
    assert kv.pool.counters.prefix_cache_hits == num_hit_tokens
    free_all(kv, a, b)


@pytest.mark.parametrize(("changed", "num_hit_tokens"), [(0, 0), (15, 0), (16, 16), (31, 16), (32, 32), (40, 32)])
def test_prompts_differing_in_one_token_share_only_the_blocks_before_it(changed: int, num_hit_tokens: int) -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = Seq(1, tokens(41))
    admit(kv, a)
    other = tokens(41)
    other[changed] = 7
    b = Seq(2, other)
    assert admit(kv, b) == num_hit_tokens
    shared = set(kv.block_table(1)) & set(kv.block_table(2))
    assert len(shared) == num_hit_tokens // BS
    free_all(kv, a, b)


def test_chain_hash_hits_need_the_same_prefix() -> None:
    """Block 1 equal, block 0 different: no hit, since the hash chains the parent."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = Seq(1, tokens(16, start=0) + tokens(17, start=500))
    admit(kv, a)
    b = Seq(2, tokens(16, start=100) + tokens(17, start=500))
    assert kv.get_computed_blocks(b) == []
    free_all(kv, a)


def test_extra_key_separates_caches() -> None:
    kv_a = KVCacheManager(num_blocks=8, block_size=BS, extra_key=b"model-a")
    kv_b = KVCacheManager(num_blocks=8, block_size=BS, extra_key=b"model-b")
    for kv in (kv_a, kv_b):
        admit(kv, Seq(1, tokens(33)))
    assert kv_a.seq_blocks[1][0].block_hash != kv_b.seq_blocks[1][0].block_hash


def test_evicted_prompt_gets_no_hit() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = Seq(1, tokens(33))
    admit(kv, a)
    kv.free(1)
    assert kv.pool.state_counts()["cached"] == 2
    filler = Seq(2, tokens(8 * BS, start=5000))
    assert kv.allocate_slots(filler, 8 * BS)  # every block, cached ones too
    assert kv.pool.state_counts()["cached"] == 0 and kv.pool.counters.evictions == 2
    assert not kv.allocate_slots(Seq(3, tokens(1)), 1)
    check(kv)
    kv.free(2)
    again = Seq(4, tokens(33))
    assert kv.get_computed_blocks(again) == []
    assert admit(kv, again) == 0
    free_all(kv, again)


def test_partial_eviction_takes_the_tail_first() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = Seq(1, tokens(49))  # blocks 0..2 full and cached, block 3 partial
    admit(kv, a)
    kv.free(1)
    # 4 never-used blocks, then a's blocks tail first: 3 (partial), 2, 1, 0
    filler = Seq(2, tokens(6 * BS, start=5000))
    assert kv.allocate_slots(filler, 6 * BS)
    assert kv.pool.counters.evictions == 1  # block 2, the chain's last full block
    b = Seq(3, tokens(49))
    assert len(kv.get_computed_blocks(b)) == 2
    free_all(kv, filler)


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = Seq(1, tokens(33))
    admit(kv, a)
    kv.free(1)  # 2 cached blocks, 4 free in all
    b = Seq(2, tokens(33) + tokens(60, start=9000))  # 2 hits + 61 tokens = 6 blocks
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2
    before = ([blk.block_id for blk in kv.pool.free_queue], dict(kv.pool.cached), bytes(kv.pool.states))
    assert not kv.allocate_slots(b, len(b.token_ids) - 32, hits)
    assert ([blk.block_id for blk in kv.pool.free_queue], dict(kv.pool.cached), bytes(kv.pool.states)) == before
    assert not kv.has_blocks(2)
    check(kv)
    b.token_ids = b.token_ids[:60]  # 2 hits + 28 tokens = 4 blocks: fits, reviving both hits
    assert kv.allocate_slots(b, 28, hits)
    assert kv.pool.num_free_blocks == 0 and kv.pool.counters.evictions == 0
    b.num_computed_tokens = 32
    compute(kv, b, 28)
    free_all(kv, b)


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = Seq(1, tokens(40))
    admit(kv, a)
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(Seq(2, tokens(40))) == []
    before = kv.pool.counters.prefix_cache_queries
    kv.record_prefix_query(40, 0)  # still counted: session pins reuse tokens without the prefix cache
    assert kv.pool.counters.prefix_cache_queries - before == 40
    assert kv.pool.counters.prefix_cache_hits == 0
    free_all(kv, a)
    assert kv.pool.state_counts()["cached"] == 0


def test_chunked_prefill_commits_blocks_as_they_fill() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = Seq(1, tokens(50))
    assert kv.allocate_slots(a, 10)
    compute(kv, a, 10)
    assert kv.pool.cached == {}
    assert kv.allocate_slots(a, 30)
    compute(kv, a, 30)
    assert len(kv.pool.cached) == 2
    assert len(kv.get_computed_blocks(Seq(2, tokens(50)))) == 2
    assert kv.allocate_slots(a, 10)
    compute(kv, a, 10)
    assert len(kv.pool.cached) == 3
    free_all(kv, a)


# ------------------------------------------------------ fork, copy-on-write


def test_fork_four_ways_copies_only_the_shared_partial_block() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    parent = Seq(1, tokens(20))
    admit(kv, parent)
    parent.token_ids.append(1)  # sampled, not yet computed
    full, partial = kv.seq_blocks[1]
    seqs = [parent]
    for i in range(2, 5):
        child = Seq(i, list(parent.token_ids), parent.num_computed_tokens)
        child.token_ids[-1] = i  # each sample differs
        kv.fork(parent, child)
        seqs.append(child)
        check(kv)
    assert full.ref_cnt == 4 and partial.ref_cnt == 4
    assert kv.pool.states[full.block_id] == kv.pool.states[partial.block_id] == BlockState.SHARED
    assert all(kv.block_table(s.seq_id) == [full.block_id, partial.block_id] for s in seqs)
    copies = []
    for n, s in enumerate(seqs[1:] + seqs[:1]):
        assert kv.allocate_slots(s, 1)
        got = kv.take_copies()
        assert kv.take_copies() == []
        if n < 3:  # the last holder writes in place
            (src, dst) = got[0]
            assert len(got) == 1 and src == partial.block_id and dst != partial.block_id
            assert kv.block_table(s.seq_id) == [full.block_id, dst]
            copies.append(dst)
        else:
            assert got == [] and kv.block_table(s.seq_id) == [full.block_id, partial.block_id]
        assert kv.pool.counters.cow_copies == len(copies)
        assert partial.ref_cnt == (3 - n if n < 3 else 1)
        compute(kv, s, 1)
    assert full.ref_cnt == 4  # full shared blocks are never copied
    assert len(set(copies)) == 3
    # 16 more decode steps: block 1 fills, is committed per sequence, no more copies
    for _ in range(15):
        for s in seqs:
            assert decode(kv, s, 7)
    assert kv.take_copies() == [] and kv.pool.counters.cow_copies == 3
    free_all(kv, *seqs)


def test_fork_at_a_block_boundary_makes_no_copy() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = Seq(1, tokens(32))
    admit(kv, parent)
    parent.token_ids.append(1)
    child = Seq(2, list(parent.token_ids), parent.num_computed_tokens)
    child.token_ids[-1] = 2
    kv.fork(parent, child)
    for s in (parent, child):
        assert kv.allocate_slots(s, 1)
        assert kv.take_copies() == []
        compute(kv, s, 1)
    assert kv.pool.counters.cow_copies == 0
    assert kv.block_table(1)[:2] == kv.block_table(2)[:2]
    assert kv.block_table(1)[2] != kv.block_table(2)[2]
    free_all(kv, parent, child)


def test_copy_on_write_counts_toward_the_free_block_check() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    parent = Seq(1, tokens(20))
    admit(kv, parent)
    parent.token_ids.append(1)
    child = Seq(2, list(parent.token_ids), parent.num_computed_tokens)
    kv.fork(parent, child)
    filler = Seq(3, tokens(1))
    assert kv.allocate_slots(filler, 1)  # the pool is now full
    assert not kv.allocate_slots(child, 1)  # needs a copy, none free
    assert kv.take_copies() == [] and kv.pool.counters.cow_copies == 0
    check(kv)
    free_all(kv, parent, child, filler)


def forked_pair(kv: KVCacheManager, parent_id: int, start: int) -> tuple[Seq, Seq]:
    parent = Seq(parent_id, tokens(20, start=start))
    admit(kv, parent)
    parent.token_ids.append(1)
    child = Seq(parent_id + 1, list(parent.token_ids), parent.num_computed_tokens)
    child.token_ids[-1] = 2
    kv.fork(parent, child)
    return parent, child


def test_swap_out_after_copy_on_write_in_the_same_step_reads_the_source() -> None:
    """The runner applies swap-outs before COW copies: the copied block is still empty then."""
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=4)
    parent, child = forked_pair(kv, 1, 0)  # blocks 0, 1 shared
    other = Seq(3, tokens(16, start=500))
    admit(kv, other)  # block 2; block 3 is the last free one
    other.token_ids.append(9)
    assert kv.allocate_slots(child, 1)  # COW: 1 -> 3
    assert kv.block_table(2) == [0, 3]
    # the scheduler now fails to fit `other` and preempts the newest (the child) by swap
    out = kv.swap_out(child)
    assert [d for d, _ in out] == [0, 1]  # block 3 holds nothing until the copies run
    assert kv.take_copies() == []  # the copy into the freed block 3 is moot
    assert kv.allocate_slots(other, 1)  # and block 3 is reused at once
    assert kv.block_table(3) == [2, 3]
    check(kv)
    free_all(kv, parent, child, other)


def test_copy_into_a_block_freed_in_the_same_step_is_dropped() -> None:
    """Otherwise the reused block would be the destination of two copies in one batch."""
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    a, b = forked_pair(kv, 1, 0)  # blocks 0, 1
    c, d = forked_pair(kv, 3, 500)  # blocks 2, 3; block 4 free
    assert kv.allocate_slots(b, 1)  # COW 1 -> 4
    kv.free(b.seq_id)  # preempted by recompute in the same step
    assert kv.allocate_slots(d, 1)  # COW 3 -> 4: the same destination
    assert kv.take_copies() == [(3, 4)]
    check(kv)
    free_all(kv, a, c, d)


def test_children_free_in_any_order() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = Seq(1, tokens(40))
    admit(kv, parent)
    kids = [Seq(i, list(parent.token_ids), parent.num_computed_tokens) for i in (2, 3)]
    for k in kids:
        kv.fork(parent, k)
    kv.free(1)
    check(kv)
    assert all(b.ref_cnt == 2 for b in kv.seq_blocks[2])
    free_all(kv, *kids)


# -------------------------------------------------------------------- swap


def test_swap_round_trip() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=4)
    seq = Seq(1, tokens(40))
    admit(kv, seq)
    seq.token_ids.append(5)
    table = kv.block_table(1)
    assert kv.can_swap_out(1)
    out = kv.swap_out(seq)
    assert [d for d, _ in out] == table
    host_ids = [h for _, h in out]
    assert len(set(host_ids)) == 3 and all(0 <= h < 4 for h in host_ids)
    assert kv.host.num_used_blocks == 3 and kv.swapped == {1: host_ids}
    assert not kv.has_blocks(1) and kv.pool.num_free_blocks == 8
    assert kv.num_swapped_out_blocks == 3
    check(kv)
    back = kv.swap_in(seq)
    assert back is not None
    assert [h for h, _ in back] == host_ids
    assert kv.block_table(1) == [d for _, d in back] and len(kv.block_table(1)) == 3
    assert kv.host.num_used_blocks == 0 and not kv.swapped
    check(kv)
    assert decode(kv, seq, 6)  # continues into its partial block
    assert len(kv.block_table(1)) == 3
    free_all(kv, seq)


def test_swap_out_drops_preallocated_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=8)
    seq = Seq(1, tokens(60))
    assert kv.allocate_slots(seq, 40)
    compute(kv, seq, 16)  # slots for 40, only 16 computed (preempted mid-step)
    out = kv.swap_out(seq)
    assert len(out) == 1 and kv.host.num_used_blocks == 1
    check(kv)
    assert kv.swap_in(seq) is not None
    free_all(kv, seq)


def test_swap_refused_when_the_host_is_full() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=2)
    a = Seq(1, tokens(20))
    admit(kv, a)
    kv.swap_out(a)
    b = Seq(2, tokens(5, start=50))
    admit(kv, b)
    assert not kv.can_swap_out(2)  # host full
    with pytest.raises(ValueError):
        kv.swap_out(b)
    assert kv.has_blocks(2)  # the refused swap changed nothing
    check(kv)
    kv.free(1)  # frees the host blocks too
    assert kv.host.num_used_blocks == 0 and kv.can_swap_out(2)
    free_all(kv, b)


def test_swap_in_refused_when_the_pool_is_full() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS, num_host_blocks=3)
    a = Seq(1, tokens(40))
    admit(kv, a)
    kv.swap_out(a)
    filler = Seq(2, tokens(1))
    assert kv.allocate_slots(filler, 20)
    assert kv.swap_in(a) is None
    assert kv.swapped[1] and not kv.has_blocks(1)
    check(kv)
    free_all(kv, a, filler)


def test_host_tier_is_capped_at_the_pool_size() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=100)
    assert kv.host.num_blocks == 4


def test_everything_together_ends_with_every_block_free() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS, max_pinned_blocks=6, num_host_blocks=6)
    a = Seq(1, tokens(33))
    admit(kv, a)
    a.token_ids.append(1)
    b = Seq(2, list(a.token_ids), a.num_computed_tokens)
    kv.fork(a, b)
    c = Seq(3, tokens(40))
    assert admit(kv, c) == 32
    assert decode(kv, a, 2) and decode(kv, b, 3)
    kv.swap_out(b)
    assert finish_turn(kv, "s", c)
    kv.swap_in(b)
    d = Seq(4, c.token_ids + [8, 9])
    d.num_computed_tokens = kv.adopt_session("s", d)
    assert d.num_computed_tokens == 40
    assert kv.allocate_slots(d, 3)
    compute(kv, d, 3)
    assert finish_turn(kv, "s", d)
    check(kv)
    free_all(kv, a, b)
