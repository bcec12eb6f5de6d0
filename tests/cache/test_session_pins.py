"""Session pins: SessionPins and SessionPin on their own, then pin / adopt / release through KVCacheManager."""

from __future__ import annotations

import pytest
from cache_helpers import BS, Seq, admit, check, compute, finish_turn, free_all, tokens

from streamkv.cache.block import BlockState
from streamkv.cache.block_pool import BlockPool
from streamkv.cache.hashing import hash_block_tokens
from streamkv.cache.kv_cache_manager import KVCacheManager
from streamkv.cache.session_pins import SessionPin, SessionPins

# ------------------------------------------------------------ SessionPins


def test_pins_are_kept_least_recently_active_first_and_counted() -> None:
    pool = BlockPool(6)
    pins = SessionPins(pool, max_pinned_blocks=4)
    a, b = pool.allocate(2), pool.allocate(1)
    assert pins.least_recently_active() is None and pins.fits(4) and not pins.fits(5)
    pins.add("a", a, list(range(20)))
    pins.add("b", b, list(range(3)))
    assert list(pins) == ["a", "b"] and pins.least_recently_active() == "a"
    assert pins.num_pinned_blocks == 3 and pins.fits(1) and not pins.fits(2)
    assert [pool.states[x.block_id] for x in a + b] == [BlockState.PINNED] * 3
    pins.check_invariants()
    pin = pins.remove("a")
    assert pin is not None and pin.blocks == a and "a" not in pins and len(pins) == 1
    assert pins.num_pinned_blocks == 1 and all(x.pin_cnt == 0 and x.ref_cnt == 1 for x in a)
    assert pins.remove("a") is None
    pins.check_invariants()
    pool.free(a)  # the caller owns the references remove() handed back
    pins.remove("b")
    pool.free(b)
    pool.check_invariants({})


def test_pinning_a_session_twice_or_a_block_without_a_spare_reference_raises() -> None:
    pool = BlockPool(4)
    pins = SessionPins(pool, max_pinned_blocks=4)
    blocks = pool.allocate(1)
    pins.add("s", blocks, [1])
    with pytest.raises(ValueError, match="already pinned"):
        pins.add("s", pool.allocate(1), [2])
    with pytest.raises(ValueError, match="without a reference"):
        pins.add("t", blocks, [1])  # its one reference is already the pin
    assert list(pins) == ["s"] and pins.num_pinned_blocks == 1


@pytest.mark.parametrize(
    ("prompt", "cached_second_block", "reusable"),
    [
        (list(range(40)), False, 20),  # the whole pin, a follow-up turn
        (list(range(20)), False, 19),  # the prompt's last token is always computed
        ([*range(10), 99, *range(11, 40)], False, 10),  # up to the first differing token
        ([*range(18), 99, 99], True, 16),  # partial use of a cached full block: back to its start
        ([*range(18), 99, 99], False, 18),  # a private block is reused up to the difference
    ],
)
def test_reusable_tokens_of_a_new_prompt(prompt: list[int], cached_second_block: bool, reusable: int) -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    if cached_second_block:  # an unrelated hash: only its presence matters here
        pool.cache_block(blocks[1], hash_block_tokens(None, list(range(16, 32))), tuple(range(16, 32)))
    pin = SessionPin("s", blocks, list(range(20)))
    assert pin.num_reusable_tokens(prompt, block_size=16) == reusable


# ----------------------------------------- pins through the KV cache manager


def test_pin_keeps_the_partial_block_and_adopt_continues_from_it() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    turn1 = Seq(1, tokens(20))
    admit(kv, turn1)
    table = kv.block_table(1)
    assert finish_turn(kv, "s", turn1)
    assert not kv.has_blocks(1)
    pin = kv.sessions["s"]
    assert [b.block_id for b in pin.blocks] == table
    assert pin.token_ids == tokens(20)
    assert kv.num_pinned_blocks == 2
    assert [kv.pool.states[i] for i in table] == [BlockState.PINNED, BlockState.PINNED]
    assert kv.pool.num_free_blocks == 6
    turn2 = Seq(2, turn1.token_ids + tokens(12, start=7000))
    n = kv.adopt_session("s", turn2)
    assert n == 20
    turn2.num_computed_tokens = n
    assert kv.block_table(2) == table  # the exact block table: nothing recomputed
    assert "s" not in kv.sessions and kv.num_pinned_blocks == 0
    assert [kv.pool.states[i] for i in table] == [BlockState.USED, BlockState.USED]
    check(kv)
    assert kv.allocate_slots(turn2, 13)  # positions 20..32: block 1 filled in place, one new block
    assert kv.take_copies() == [] and kv.block_table(2)[:2] == table and len(kv.block_table(2)) == 3
    compute(kv, turn2, 13)
    assert kv.seq_blocks[2][1].block_hash is not None  # block 1 filled in turn 2 and is cached
    assert finish_turn(kv, "s", turn2)
    assert kv.sessions["s"].token_ids == turn2.token_ids[:33]
    free_all(kv)


def test_pin_at_a_block_boundary_and_single_token_turns() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    turn1 = Seq(1, tokens(32))
    admit(kv, turn1)
    assert finish_turn(kv, "s", turn1)
    assert len(kv.sessions["s"].blocks) == 2
    turn2 = Seq(2, list(turn1.token_ids))  # only the sampled token is new
    assert kv.adopt_session("s", turn2) == 32
    turn2.num_computed_tokens = 32
    assert kv.allocate_slots(turn2, 1)
    compute(kv, turn2, 1)
    assert len(kv.block_table(2)) == 3
    free_all(kv, turn2)


def test_pins_over_the_budget_unpin_the_least_recently_active_session() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, max_pinned_blocks=4)
    for i, sid in enumerate("abc"):
        s = Seq(i, tokens(20, start=100 * i))
        admit(kv, s)
        assert finish_turn(kv, sid, s)
    assert list(kv.sessions) == ["b", "c"]  # a was the least recently active
    assert kv.num_pinned_blocks == 4
    # a's full block stays in the prefix cache, its partial block is plain free
    assert len(kv.get_computed_blocks(Seq(99, tokens(20, start=0)))) == 1
    # re-pinning b makes it the most recent; d then displaces c
    s = Seq(10, tokens(20, start=100) + [3])
    kv.adopt_session("b", s)
    s.num_computed_tokens = 20
    assert finish_turn(kv, "b", s)
    assert list(kv.sessions) == ["c", "b"]
    d = Seq(11, tokens(40, start=900))  # 3 blocks: both others must go
    admit(kv, d)
    assert finish_turn(kv, "d", d)
    assert list(kv.sessions) == ["d"] and kv.num_pinned_blocks == 3
    free_all(kv)


def test_an_oversized_turn_is_not_pinned() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, max_pinned_blocks=2)
    small = Seq(1, tokens(10, start=0))
    admit(kv, small)
    assert finish_turn(kv, "small", small)
    big = Seq(2, tokens(40))
    admit(kv, big)
    assert not finish_turn(kv, "big", big)
    assert list(kv.sessions) == ["small"]  # nobody was unpinned for nothing
    assert not kv.has_blocks(2)
    assert kv.pool.state_counts()["cached"] == 2  # big's full blocks stay cached
    # a turn with nothing computed pins nothing
    empty = Seq(3, tokens(4))
    assert not kv.pin_session("e", empty)
    assert "e" not in kv.sessions
    free_all(kv)


def test_pinning_a_session_again_replaces_its_pin() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    one = Seq(1, tokens(20))
    admit(kv, one)
    assert finish_turn(kv, "s", one)
    other = Seq(2, tokens(5, start=300))  # the same session id, not adopted
    admit(kv, other)
    assert finish_turn(kv, "s", other)
    assert kv.sessions["s"].token_ids == tokens(5, start=300)
    assert kv.num_pinned_blocks == 1
    free_all(kv)


@pytest.mark.parametrize(
    "how, reused",
    [
        ("changed", 35),  # differs inside the partial block: reuse up to the difference
        ("equal", 39),  # nothing new: the last token must still be computed
        ("shorter", 16),  # ends inside a cached full block: never overwrite it, stop at its start
        ("unrelated", 0),
    ],
)
def test_adopt_reuses_the_longest_common_prefix(how: str, reused: int) -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    turn1 = Seq(1, tokens(40))
    admit(kv, turn1)
    assert finish_turn(kv, "s", turn1)
    old_table = [b.block_id for b in kv.sessions["s"].blocks]
    history = tokens(40)
    if how == "changed":
        history[35] = 1
        prompt = history + [5, 6]
    elif how == "equal":
        prompt = history
    elif how == "shorter":
        prompt = history[:30]
    else:
        prompt = [7] + history
    turn2 = Seq(2, prompt)
    assert kv.adopt_session("s", turn2) == reused
    assert "s" not in kv.sessions and kv.num_pinned_blocks == 0
    if reused:
        assert kv.block_table(2) == old_table[: -(-reused // BS)]
        turn2.num_computed_tokens = reused
        assert kv.allocate_slots(turn2, len(prompt) - reused)
    else:
        assert not kv.has_blocks(2)
    check(kv)
    assert kv.adopt_session("missing", Seq(3, tokens(3))) == 0
    free_all(kv, turn2)


def test_adopt_into_a_sequence_holding_blocks_releases_the_pin() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    turn1 = Seq(1, tokens(20))
    admit(kv, turn1)
    assert finish_turn(kv, "s", turn1)
    turn2 = Seq(2, turn1.token_ids + [9])
    admit(kv, turn2)
    assert kv.adopt_session("s", turn2) == 0
    assert not kv.sessions
    free_all(kv, turn2)


def test_pinned_blocks_shared_with_a_fork_are_copied_on_write() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = Seq(1, tokens(20))
    admit(kv, parent)
    child = Seq(2, list(parent.token_ids), parent.num_computed_tokens)
    kv.fork(parent, child)
    assert finish_turn(kv, "s", parent)
    partial = kv.sessions["s"].blocks[1]
    assert partial.ref_cnt == 2 and partial.pin_cnt == 1
    child.token_ids.append(4)
    assert kv.allocate_slots(child, 1)
    ((src, dst),) = kv.take_copies()
    assert src == partial.block_id and kv.block_table(2)[1] == dst
    compute(kv, child, 1)
    assert partial.ref_cnt == 1 and kv.pool.states[partial.block_id] == BlockState.PINNED
    free_all(kv, child)


def test_unpin_lru_and_release() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    for i, sid in enumerate("ab"):
        s = Seq(i, tokens(5, start=10 * i))
        admit(kv, s)
        finish_turn(kv, sid, s)
    assert kv.release_session("b") and not kv.release_session("b")
    assert kv.unpin_lru() and not kv.unpin_lru()
    free_all(kv)
