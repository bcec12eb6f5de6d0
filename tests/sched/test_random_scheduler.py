"""Randomized liveness (issue #15 item 3): the real Scheduler and KVCacheManager under a fake
model, over random pools, budgets, sessions (pins, next turns), cancels, parallel samples and
both preemption modes. Every request finishes within the scheduler's documented bound, no
sequence is preempted more than ``max_preemptions`` times, and the pool comes back whole."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from streamkv.sched.request import Request
from tests.sched.sched_driver import SchedulerDriver

NUM_SEEDS = 100
MAX_ARRIVALS = 24
MAX_STEPS = 20_000  # per run; the documented bound is checked below, this only stops a wedge early


@dataclass(slots=True)
class Scenario:
    num_blocks: int
    block_size: int
    budget: int
    max_num_seqs: int
    mode: str
    prefix_caching: bool
    pinned_fraction: float
    host_blocks: int
    max_preemptions: int


def _scenario(rng: random.Random) -> Scenario:
    num_blocks = rng.randint(3, 24)
    return Scenario(
        num_blocks=num_blocks,
        block_size=rng.choice([2, 4, 8, 16]),
        budget=rng.choice([1, 2, 3, 5, 8, 16, 32, 64, 512]),
        max_num_seqs=rng.choice([1, 2, 3, 4, 8, 64]),
        mode=rng.choice(["recompute", "swap"]),
        prefix_caching=rng.random() < 0.7,
        pinned_fraction=rng.choice([0.0, 0.25, 0.5, 1.0]),
        host_blocks=rng.randint(0, num_blocks),
        max_preemptions=rng.choice([1, 2, 3]),
    )


def _prompt(rng: random.Random, length: int, shared: list[list[int]]) -> list[int]:
    """Often starts with a shared 'system prompt', so prefix hits happen."""
    head = rng.choice(shared)[: rng.randint(0, length)] if rng.random() < 0.6 else []
    return head + [rng.randint(1, 999) for _ in range(length - len(head))]


def _run(seed: int) -> None:
    rng = random.Random(seed)
    sc = _scenario(rng)
    d = SchedulerDriver(
        sc.num_blocks,
        block_size=sc.block_size,
        enable_prefix_caching=sc.prefix_caching,
        max_pinned_fraction=sc.pinned_fraction,
        num_host_blocks=sc.host_blocks,
        max_num_batched_tokens=sc.budget,
        max_num_seqs=sc.max_num_seqs,
        preemption_mode=sc.mode,
        max_preemptions=sc.max_preemptions,
    )
    capacity = sc.num_blocks * sc.block_size
    shared = [[rng.randint(1, 999) for _ in range(capacity)] for _ in range(2)]
    last_turn: dict[str, Request] = {}  # session id -> its latest request
    arrivals = 0
    total_tokens = 0  # sum over sequences of prompt + max_tokens: the bound's main term
    num_seqs = 0
    busy_steps = empty_steps = preemptions = run_of_empty = 0
    while arrivals < MAX_ARRIVALS or d.scheduler.has_work():
        assert d.num_steps < MAX_STEPS, f"seed {seed}: {sc}: {d.describe()}"
        in_flight = {r.session_id for r in d.requests.values() if r.session_id is not None}
        if arrivals < MAX_ARRIVALS and rng.random() < 0.3:
            arrivals += 1
            n = rng.choice([1, 1, 1, 2, 3])
            idle = sorted(s for s in last_turn if s not in in_flight)
            sid: str | None
            if idle and rng.random() < 0.5:  # the next turn of a session: its history + a new turn
                sid = rng.choice(idle)
                history = last_turn[sid].seqs[0].token_ids
                prompt = history + [rng.randint(1, 999) for _ in range(rng.randint(1, 2 * sc.block_size))]
            else:
                sid = f"s{arrivals}" if rng.random() < 0.5 else None
                prompt = _prompt(rng, rng.randint(1, max(1, capacity // 2)), shared)
            room = capacity - len(prompt)
            if room < 1:  # the conversation outgrew the pool: close it
                if sid is not None:
                    d.release_session(sid)
                    del last_turn[sid]
                continue
            max_tokens = rng.randint(1, min(room, 3 * sc.block_size))
            eos_at = rng.randint(1, max_tokens) if rng.random() < 0.5 else None
            req = d.add(f"r{arrivals}", prompt, max_tokens, session_id=sid, eos_at=eos_at, n=n)
            total_tokens += n * (len(prompt) + max_tokens)
            num_seqs += n
            if sid is not None:
                last_turn[sid] = req
        if d.requests and rng.random() < 0.03:
            d.cancel(rng.choice(sorted(d.requests)))
        if last_turn and rng.random() < 0.02:
            sid = rng.choice(sorted(last_turn))
            if sid not in in_flight:
                d.release_session(sid)
                del last_turn[sid]
        if not d.scheduler.has_work():
            continue
        rec = d.step()
        preemptions += rec.num_preempted
        if rec.num_scheduled_tokens:
            busy_steps += 1
        else:
            empty_steps += 1
        # a step computes a token or preempts; a swap-in may leave one step empty, never two
        run_of_empty = run_of_empty + 1 if not rec.num_scheduled_tokens and not rec.num_preempted else 0
        assert run_of_empty <= 1, f"seed {seed}: {sc}: empty steps in a row: {d.describe()}"

    # the bound of the scheduler's docstring: every step computes a token or preempts,
    # each sequence computes at most (P + 1) x its tokens and is preempted at most P times
    p = sc.max_preemptions
    assert d.max_preemptions_seen <= p, (seed, sc)
    assert preemptions <= p * num_seqs
    assert busy_steps <= (p + 1) * total_tokens, (seed, sc)
    assert empty_steps <= preemptions + busy_steps + 1, (seed, sc)
    assert busy_steps + empty_steps <= 2 * ((p + 1) * total_tokens + p * num_seqs) + 1, (seed, sc)
    assert not d.requests and len(d.finished) <= arrivals
    for sid in list(d.kv.sessions):
        d.release_session(sid)
    d.assert_pool_whole()


@pytest.mark.parametrize("chunk", range(4))
def test_every_request_finishes_within_the_bound(chunk: int) -> None:
    for seed in range(chunk * NUM_SEEDS // 4, (chunk + 1) * NUM_SEEDS // 4):
        _run(seed)
