"""BlockPool, FreeBlockQueue and the block hash chain, one operation at a time."""

from __future__ import annotations

import random

import pytest
from block_state_oracle import expected_block_state

from streamkv.cache.block import STATE_NAMES, BlockState, KVBlock
from streamkv.cache.block_pool import BlockPool
from streamkv.cache.free_block_queue import FreeBlockQueue
from streamkv.cache.hashing import hash_block_tokens

BS = 4


def check(pool: BlockPool) -> None:
    """Invariants plus: state bytes and state_counts() agree with the blocks."""
    pool.check_invariants()
    indexed = {b.block_id for b in pool.cached.values()}
    want = [expected_block_state(b.ref_cnt, b.pin_cnt, b.block_id in indexed) for b in pool.blocks]
    assert list(pool.states) == [int(s) for s in want]
    counts = pool.state_counts()
    assert set(counts) == set(STATE_NAMES)
    assert sum(counts.values()) == pool.num_blocks
    for state in BlockState:
        assert counts[state.name.lower()] == want.count(state)
    assert counts["free"] + counts["cached"] == pool.num_free_blocks
    assert pool.usage() == pytest.approx(1 - pool.num_free_blocks / pool.num_blocks)


def free_order(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def fill(pool: BlockPool, block: KVBlock, tokens: tuple[int, ...], parent: bytes | None = None) -> bytes:
    """Cache ``block`` as if a sequence had just written ``tokens`` into it."""
    h = hash_block_tokens(parent, tokens)
    pool.cache_block(block, h, tokens)
    return h


# ------------------------------------------------------------- ref counts


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_touch_free_ref_counts() -> None:
    pool = BlockPool(6)
    check(pool)
    assert pool.num_free_blocks == 6
    a, b = pool.allocate(2)
    assert (a.block_id, b.block_id) == (0, 1)  # front of the queue first
    assert a.ref_cnt == b.ref_cnt == 1
    assert pool.num_free_blocks == 4
    check(pool)
    pool.touch([a])
    assert a.ref_cnt == 2
    assert pool.states[a.block_id] == BlockState.SHARED
    check(pool)
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 4
    check(pool)
    pool.free([a, b])
    assert a.ref_cnt == b.ref_cnt == 0
    assert pool.num_free_blocks == 6
    assert free_order(pool)[-2:] == [0, 1]  # freed blocks join the back
    check(pool)
    assert pool.allocate(0) == []


def test_double_free_raises() -> None:
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(ValueError, match="double free of block 0"):
        pool.free([a])
    check(pool)
    with pytest.raises(ValueError, match="double free"):
        pool.free([pool.blocks[2]])  # never allocated
    check(pool)


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    before = free_order(pool)
    with pytest.raises(ValueError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    assert free_order(pool) == before
    check(pool)


def test_pin_unpin() -> None:
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.pin([a])
    assert pool.states[0] == BlockState.PINNED
    check(pool)
    with pytest.raises(ValueError, match="without a reference"):
        pool.pin([a])  # its only reference is already a pin
    with pytest.raises(ValueError, match="without a reference"):
        pool.pin([pool.blocks[1]])
    with pytest.raises(ValueError, match="freed while pinned"):
        pool.free([a])  # its last reference is a pin: unpin first
    assert a.ref_cnt == 1 and a.pin_cnt == 1  # the refused free changed nothing
    check(pool)
    pool.touch([a])
    assert pool.states[0] == BlockState.SHARED
    pool.free([a])
    assert pool.states[0] == BlockState.PINNED
    check(pool)
    pool.unpin([a])
    assert pool.states[0] == BlockState.USED
    with pytest.raises(ValueError, match="not pinned"):
        pool.unpin([a])
    pool.free([a])
    check(pool)
    # two sessions pin one block: no plain reference is left to free
    (b,) = pool.allocate(1)
    pool.touch([b])
    pool.pin([b])
    pool.pin([b])
    with pytest.raises(ValueError, match="freed while pinned"):
        pool.free([b])
    assert b.ref_cnt == 2 and b.pin_cnt == 2
    check(pool)


# ------------------------------------------------------- caching, eviction


def test_lru_eviction_order_is_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        fill(pool, b, (i,) * BS)
    check(pool)
    for i in (2, 0, 3, 1):
        pool.free([blocks[i]])
        check(pool)
    assert free_order(pool) == [2, 0, 3, 1]
    assert pool.state_counts()["cached"] == 4
    evicted = []
    for _ in range(4):
        (b,) = pool.allocate(1)
        assert b.block_hash is None and b.token_ids is None
        evicted.append(b.block_id)
        check(pool)
    assert evicted == [2, 0, 3, 1]
    assert pool.counters.evictions == 4
    assert pool.cached == {}


def test_never_used_blocks_go_before_cached_ones() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    fill(pool, a, (1,) * BS)
    pool.free([a])
    assert [b.block_id for b in pool.allocate(3)] == [1, 2, 3]
    assert a.block_hash is not None  # still cached: plain free blocks went first
    assert pool.counters.evictions == 0
    check(pool)


def test_tail_first_free_evicts_the_chain_tail_before_its_prefix() -> None:
    pool = BlockPool(5)
    chain = pool.allocate(3)
    parent = None
    hashes = []
    for i, b in enumerate(chain):
        parent = fill(pool, b, (i, i, i, i), parent)
        hashes.append(parent)
    pool.free(reversed(chain))  # what KVCacheManager.free does
    check(pool)
    assert free_order(pool) == [3, 4, 2, 1, 0]
    pool.allocate(2)  # the two never-used blocks
    (b,) = pool.allocate(1)
    assert b is chain[2]  # the tail goes first
    assert pool.lookup(hashes[0], (0,) * BS) is chain[0]
    assert pool.lookup(hashes[1], (1,) * BS) is chain[1]
    assert pool.lookup(hashes[2], (2,) * BS) is None
    (b,) = pool.allocate(1)
    assert b is chain[1]
    assert pool.lookup(hashes[0], (0,) * BS) is chain[0]  # the prefix outlives its extensions
    check(pool)


def test_revived_cached_block_leaves_the_middle_of_the_queue() -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(5)
    hashes = [fill(pool, b, (i,) * BS) for i, b in enumerate(blocks)]
    pool.free(blocks)
    assert free_order(pool) == [0, 1, 2, 3, 4]
    hit = pool.lookup(hashes[2], (2,) * BS)
    assert hit is blocks[2]
    pool.touch([hit])  # a prefix hit revives it
    assert hit.ref_cnt == 1 and not hit.in_free_queue
    assert hit.block_hash == hashes[2]  # it stays cached while used
    assert pool.states[2] == BlockState.USED
    assert free_order(pool) == [0, 1, 3, 4]
    check(pool)
    pool.free([hit])
    assert free_order(pool) == [0, 1, 3, 4, 2]  # now the most recently used
    check(pool)
    # touching a referenced cached block just shares it
    pool.touch([hit])
    pool.touch([hit])
    assert hit.ref_cnt == 2 and pool.states[2] == BlockState.SHARED
    check(pool)


def test_cache_block_first_writer_wins_and_lookup_checks_tokens() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    tokens = (1, 2, 3, 4)
    h = fill(pool, a, tokens)
    fill(pool, b, tokens)  # an identical block: stays private
    assert b.block_hash is None and b.token_ids is None
    assert pool.cached == {h: a}
    assert pool.states[b.block_id] == BlockState.USED
    fill(pool, a, (9, 9, 9, 9))  # already cached: ignored
    assert a.block_hash == h and a.token_ids == tokens
    assert pool.lookup(h, tokens) is a
    assert pool.lookup(h, (1, 2, 3, 5)) is None  # matching hash, other tokens: a miss
    assert pool.lookup(hash_block_tokens(None, (4, 3, 2, 1)), (4, 3, 2, 1)) is None
    pool.free([a, b])
    assert pool.states[a.block_id] == BlockState.CACHED
    assert pool.states[b.block_id] == BlockState.FREE
    check(pool)


def test_caching_disabled_keeps_no_hash() -> None:
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    fill(pool, a, (1, 2, 3, 4))
    assert a.block_hash is None and pool.cached == {}
    pool.free([a])
    assert pool.state_counts()["cached"] == 0
    check(pool)


def test_evict_all_cached_spares_used_blocks() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        fill(pool, b, (i,) * BS)
    pool.free(blocks[:2])
    assert pool.evict_all_cached() == 2
    assert list(pool.cached.values()) == [blocks[2]]
    assert pool.counters.evictions == 2
    check(pool)


def test_check_invariants_has_teeth() -> None:
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.check_invariants({0: 1})
    with pytest.raises(AssertionError, match="holders 2"):
        pool.check_invariants({0: 2})
    with pytest.raises(AssertionError, match="block 1: ref_cnt 0, holders 1"):
        pool.check_invariants({0: 1, 1: 1})
    a.ref_cnt = 2  # behind the pool's back: the state byte is now stale
    with pytest.raises(AssertionError, match="state stale"):
        pool.check_invariants()
    a.ref_cnt = 0  # zero references but not in the free queue
    with pytest.raises(AssertionError, match="in free queue = False"):
        pool.check_invariants()


def test_state_bytes_follow_random_operations() -> None:
    rng = random.Random(1234)
    pool = BlockPool(8)
    refs: dict[int, int] = {}
    pins: dict[int, int] = {}
    for step in range(2000):
        op = rng.randrange(7)
        used = [b for b in pool.blocks if b.ref_cnt]
        if op == 0 and pool.num_free_blocks:
            for b in pool.allocate(rng.randint(1, pool.num_free_blocks)):
                refs[b.block_id] = 1
        elif op == 1 and used:
            b = rng.choice(used)
            if b.ref_cnt > b.pin_cnt:
                pool.free([b])
                refs[b.block_id] -= 1
        elif op == 2 and used:
            b = rng.choice(used)
            pool.touch([b])
            refs[b.block_id] += 1
        elif op == 3 and used:
            b = rng.choice(used)
            tokens = tuple(rng.randrange(3) for _ in range(BS))
            fill(pool, b, tokens)
        elif op == 4 and pool.cached:
            h = rng.choice(list(pool.cached))
            b = pool.lookup(h, pool.cached[h].token_ids or ())
            assert b is not None
            pool.touch([b])
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
        elif op == 5 and used:
            b = rng.choice(used)
            if b.pin_cnt < b.ref_cnt:
                pool.pin([b])
                pins[b.block_id] = pins.get(b.block_id, 0) + 1
        elif op == 6 and pins:
            bid = rng.choice([i for i, n in pins.items() if n])
            pool.unpin([pool.blocks[bid]])
            pins[bid] -= 1
            if not pins[bid]:
                del pins[bid]
        check(pool)
        pool.check_invariants({i: n for i, n in refs.items() if n})
        for b in pool.blocks:
            assert b.pin_cnt == pins.get(b.block_id, 0), step


# ------------------------------------------------------------ free queue


class Node:
    """A stand-in block that records which nodes the queue reads or writes."""

    touched: set[int] = set()

    def __init__(self, block_id: int) -> None:
        object.__setattr__(self, "block_id", block_id)
        object.__setattr__(self, "prev_free", None)
        object.__setattr__(self, "next_free", None)
        object.__setattr__(self, "in_free_queue", False)

    def __getattribute__(self, name: str) -> object:
        if name in ("prev_free", "next_free", "in_free_queue"):
            Node.touched.add(object.__getattribute__(self, "block_id"))
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: object) -> None:
        Node.touched.add(object.__getattribute__(self, "block_id"))
        object.__setattr__(self, name, value)


def ids(q: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in q]


def test_free_queue_remove_head_middle_tail() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[0])  # head
    assert ids(q) == [1, 2, 3, 4]
    q.remove(blocks[2])  # middle
    assert ids(q) == [1, 3, 4]
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    q.remove(blocks[4])  # tail
    assert ids(q) == [1, 3] and len(q) == 2
    for b in (blocks[0], blocks[2], blocks[4]):
        assert b.prev_free is None and b.next_free is None and not b.in_free_queue
    q.append(blocks[2])
    assert ids(q) == [1, 3, 2]
    assert q.popleft() is blocks[1]
    q.remove(blocks[2])
    q.remove(blocks[3])  # the only one left
    assert ids(q) == [] and len(q) == 0
    with pytest.raises(IndexError):
        q.popleft()
    q.append(blocks[4])
    assert ids(q) == [4] and q.popleft() is blocks[4]


def test_free_queue_rejects_misuse() -> None:
    blocks = [KVBlock(i) for i in range(2)]
    q = FreeBlockQueue(blocks)
    with pytest.raises(ValueError, match="already free"):
        q.append(blocks[0])
    q.remove(blocks[0])
    with pytest.raises(ValueError, match="not free"):
        q.remove(blocks[0])
    assert ids(q) == [1] and len(q) == 1


@pytest.mark.parametrize("victim", [0, 500, 999])
def test_free_queue_remove_is_constant_time(victim: int) -> None:
    """Removing any block reads and writes only it and its two neighbours."""
    nodes = [Node(i) for i in range(1000)]
    q = FreeBlockQueue(nodes)  # type: ignore[arg-type]
    Node.touched = set()
    q.remove(nodes[victim])  # type: ignore[arg-type]
    assert Node.touched <= {victim - 1, victim, victim + 1}
    Node.touched = set()
    q.popleft()
    assert len(Node.touched) <= 2
    Node.touched = set()
    q.append(nodes[victim])  # type: ignore[arg-type]
    assert Node.touched <= {victim, 999 if victim != 999 else 998}
    assert len(q) == 999


# --------------------------------------------------------------- hashing


def test_hash_is_deterministic_and_32_bytes() -> None:
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == 32
    assert h == hash_block_tokens(None, (1, 2, 3, 4))
    assert h != hash_block_tokens(None, [1, 2, 4, 3])


def test_same_tokens_different_parent_different_hash() -> None:
    tokens = [5, 6, 7, 8]
    p1 = hash_block_tokens(None, [1, 1, 1, 1])
    p2 = hash_block_tokens(None, [1, 1, 1, 2])
    hashes = {hash_block_tokens(None, tokens), hash_block_tokens(p1, tokens), hash_block_tokens(p2, tokens)}
    assert len(hashes) == 3


def test_extra_key_changes_the_hash() -> None:
    tokens = [5, 6, 7, 8]
    base = hash_block_tokens(None, tokens)
    assert hash_block_tokens(None, tokens, b"model-a") != base
    assert hash_block_tokens(None, tokens, b"model-a") != hash_block_tokens(None, tokens, b"model-b")
    assert hash_block_tokens(None, tokens, b"model-a") == hash_block_tokens(None, tokens, b"model-a")
    # the key is length-prefixed: key bytes cannot pose as token bytes
    one = (1).to_bytes(8, "little")
    assert hash_block_tokens(None, [1, 5, 6, 7, 8], b"") != hash_block_tokens(None, tokens, one)


def test_hash_covers_the_full_token_range() -> None:
    big = [2**40, 2**40 + 1, 0, 1]
    assert hash_block_tokens(None, big) != hash_block_tokens(None, [0, 1, 0, 1])  # no 32-bit truncation
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])


def test_lookup_with_matching_hash_but_other_tokens_misses() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    h = hash_block_tokens(None, (1, 2, 3, 4))
    pool.cache_block(a, h, (1, 2, 3, 4))
    pool.free([a])
    assert pool.lookup(h, (1, 2, 3, 4)) is a
    assert pool.lookup(h, (1, 2, 3, 9)) is None
    assert pool.lookup(h, (1, 2, 3)) is None
    check(pool)
