"""The duck-typed sequence and the admit / compute / decode / finish-turn steps the cache-manager tests share."""

from __future__ import annotations

from dataclasses import dataclass, field

from streamkv.cache.kv_cache_manager import KVCacheManager

BS = 16


@dataclass
class Seq:
    """The duck-typed sequence the cache manager reads."""

    seq_id: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def check(kv: KVCacheManager) -> None:
    kv.check_invariants()
    counts = kv.pool.state_counts()
    assert counts["free"] + counts["cached"] == kv.pool.num_free_blocks


def admit(kv: KVCacheManager, seq: Seq) -> int:
    """Prefix lookup, allocate and compute the whole prompt; returns the hit tokens."""
    hits = kv.get_computed_blocks(seq)
    num_hit_tokens = len(hits) * BS
    n = len(seq.token_ids) - num_hit_tokens
    assert kv.allocate_slots(seq, n, hits)
    kv.record_prefix_query(len(seq.token_ids), num_hit_tokens)
    seq.num_computed_tokens += num_hit_tokens
    compute(kv, seq, n)
    return num_hit_tokens


def compute(kv: KVCacheManager, seq: Seq, n: int) -> None:
    """The forward wrote ``n`` more tokens (slots already allocated)."""
    assert len(kv.block_table(seq.seq_id)) * BS >= seq.num_computed_tokens + n
    seq.num_computed_tokens += n
    kv.commit(seq)
    check(kv)


def decode(kv: KVCacheManager, seq: Seq, token: int) -> bool:
    """Sample ``token``, then compute the previously sampled one."""
    if seq.num_computed_tokens == len(seq.token_ids):
        seq.token_ids.append(token)
    if not kv.allocate_slots(seq, 1):
        return False
    compute(kv, seq, 1)
    return True


def free_all(kv: KVCacheManager, *seqs: Seq) -> None:
    for s in seqs:
        kv.free(s.seq_id)
    while kv.unpin_lru():
        pass
    check(kv)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert kv.pool.state_counts()["free"] + kv.pool.state_counts()["cached"] == kv.pool.num_blocks
    assert kv.host.num_free_blocks == kv.host.num_blocks
    assert kv.num_pinned_blocks == 0 and not kv.sessions and not kv.seq_blocks and not kv.swapped


def finish_turn(kv: KVCacheManager, sid: str, seq: Seq, sampled: int = 3) -> bool:
    seq.token_ids.append(sampled)  # the last sample is never computed
    ok = kv.pin_session(sid, seq)
    kv.free(seq.seq_id)  # what the scheduler does next: a no-op after a pin
    check(kv)
    return ok
