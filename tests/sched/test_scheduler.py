"""Scheduler policy over the real KV cache manager, no model (like vLLM's tests/v1/core/test_scheduler.py).

Blocks hold 4 tokens. A prompt of 7 tokens takes 2 blocks; after its prefill
and one decode it has computed 8 tokens, so its next decode needs a third
block: that is how these tests run a pool dry on purpose.
"""

from __future__ import annotations

import pytest

from streamkv.errors import EngineError
from streamkv.sampling_params import SamplingParams
from streamkv.sched.request import SeqStatus, Sequence
from streamkv.sched.scheduler import Scheduler
from tests.sched.factory import BLOCK_SIZE, SAMPLED, make_scheduler, make_seq, num_new_tokens, step, validate


def add(scheduler: Scheduler, *prompt_lens: int) -> list[int]:
    """Queue one new request per prompt length; returns their seq ids in arrival order."""
    ids = []
    for n in prompt_lens:
        seq = make_seq(n)
        scheduler.add(seq)
        ids.append(seq.seq_id)
    return ids


def fill_to_the_third_block(scheduler: Scheduler, num_seqs: int) -> list[int]:
    """``num_seqs`` prompts of 7 tokens, prefilled and decoded once: each holds 2 blocks, 8 tokens computed."""
    ids = add(scheduler, *[7] * num_seqs)
    assert num_new_tokens(step(scheduler)) == dict.fromkeys(ids, 7)
    assert num_new_tokens(step(scheduler)) == dict.fromkeys(ids, 1)
    return ids


def seq_of(scheduler: Scheduler, seq_id: int) -> Sequence:
    queues = [*scheduler.running, *scheduler.swapped, *scheduler.waiting]
    (seq,) = [s for s in queues if s.seq_id == seq_id]
    return seq


# ---------------------------------------------------------------- token budget


def test_the_token_budget_caps_a_step_and_the_rest_waits_for_the_next() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    a, b, c = add(scheduler, 6, 6, 6)
    out = step(scheduler)
    assert num_new_tokens(out) == {a: 6, b: 4}  # c: no budget left, still waiting
    assert out.num_batched_tokens == 10
    assert [s.seq_id for s in scheduler.waiting] == [c]
    # a decodes, b finishes its prompt, c starts: 1 + 2 + 6 of the 10
    assert list(num_new_tokens(step(scheduler)).items()) == [(a, 1), (b, 2), (c, 6)]


def test_max_num_seqs_caps_the_sequences_of_a_step() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    a, b, c = add(scheduler, 3, 3, 3)
    assert num_new_tokens(step(scheduler)) == {a: 3, b: 3}
    assert num_new_tokens(step(scheduler)) == {a: 1, b: 1}  # running first: c still waits
    assert [s.seq_id for s in scheduler.waiting] == [c]


# -------------------------------------------------------------------- ordering


def test_decodes_go_before_partial_prefills_whatever_their_arrival() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    old_long, new_short = make_seq(30), make_seq(3)
    scheduler.add(new_short)  # queued first, arrived second
    scheduler.add(old_long)
    assert list(num_new_tokens(step(scheduler)).items()) == [(new_short.seq_id, 3), (old_long.seq_id, 5)]
    # new_short decodes; the older partial prefill gets what is left, after it
    assert list(num_new_tokens(step(scheduler)).items()) == [(new_short.seq_id, 1), (old_long.seq_id, 7)]


def test_swap_ins_come_after_running_sequences_and_before_waiting_ones() -> None:
    scheduler = make_scheduler(7, preemption_mode="swap", num_host_blocks=7)
    a, b, e = fill_to_the_third_block(scheduler, 3)  # 6 of 7 blocks used
    out = step(scheduler)  # a takes the last block; b needs one: e (the newest) is swapped out
    assert num_new_tokens(out) == {a: 1, b: 1}
    assert seq_of(scheduler, e).status is SeqStatus.SWAPPED
    host_ids = sorted(h for _, h in out.swap_out)
    assert len(host_ids) == 2

    late = make_seq(2)
    scheduler.add(late)
    out = step(scheduler)  # e needs 3 blocks, 1 is free: it stays out, and nothing waiting jumps ahead of it
    assert num_new_tokens(out) == {a: 1, b: 1} and out.swap_in == []
    assert list(scheduler.waiting) == [late]

    scheduler.finish(seq_of(scheduler, b), SeqStatus.FINISHED_STOPPED)  # 3 blocks back: 4 free
    out = step(scheduler)
    assert list(num_new_tokens(out).items()) == [(a, 1), (e, 1), (late.seq_id, 2)]
    assert sorted(h for h, _ in out.swap_in) == host_ids
    swapped_in = next(s for s in out.scheduled if s.seq.seq_id == e)
    assert swapped_in.start_pos == 8  # its computed tokens came back with it; only the next one is computed
    assert scheduler.kv.host.num_used_blocks == 0


# ------------------------------------------------------------- chunk boundaries


def test_a_chunked_prompt_covers_each_token_once_and_samples_only_at_its_end() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    seq = make_seq(10)
    prompt = list(seq.token_ids)
    scheduler.add(seq)
    chunks = []
    for _ in range(4):
        (s,) = step(scheduler).scheduled
        assert len(s.block_table) == -(-(s.start_pos + len(s.token_ids)) // BLOCK_SIZE)
        chunks.append((s.start_pos, s.token_ids, s.samples))
    assert chunks == [
        (0, prompt[0:4], False),
        (4, prompt[4:8], False),
        (8, prompt[8:10], True),
        (10, [SAMPLED], True),  # then decode: the sampled token is fed back
    ]
    assert seq.num_computed_tokens == 11


@pytest.mark.parametrize(
    ("prompt_len", "first_computed"),
    [
        (10, 8),  # two full blocks hit; the last two tokens are computed
        (8, 4),  # a hit never covers the last token (its logits are needed): the second full block is recomputed
        (4, 0),  # one block, the last token in it: no hit at all
    ],
)
def test_prefix_hits_start_the_prefill_at_a_block_boundary_before_the_last_token(
    prompt_len: int, first_computed: int
) -> None:
    scheduler = make_scheduler()
    first = make_seq(prompt_len)
    scheduler.add(first)
    step(scheduler)
    prompt = first.token_ids[:prompt_len]
    again = make_seq(prompt)
    scheduler.add(again)
    (_, s) = step(scheduler).scheduled
    assert s.seq is again
    assert (s.start_pos, s.token_ids) == (first_computed, prompt[first_computed:])
    assert again.request.num_cached_tokens == first_computed


# ------------------------------------------------------------------ preemption


def test_the_newest_running_sequence_is_preempted_first_and_requeued_at_the_front() -> None:
    scheduler = make_scheduler(6)
    waiting = make_seq(3)
    a, b, e = fill_to_the_third_block(scheduler, 3)  # all 6 blocks used
    scheduler.add(waiting)
    out = step(scheduler)
    assert num_new_tokens(out) == {a: 1, b: 1}
    assert out.num_preempted == 1
    victim = seq_of(scheduler, e)
    assert (victim.status, victim.num_computed_tokens, victim.num_preemptions) == (SeqStatus.WAITING, 0, 1)
    assert [s.seq_id for s in scheduler.waiting] == [e, waiting.seq_id]  # nothing admitted in a preempting step
    assert not scheduler.kv.has_blocks(e)
    assert scheduler.counters.preemptions_recompute == 1


def test_a_sequence_that_is_itself_the_newest_preempts_itself() -> None:
    scheduler = make_scheduler(5)
    a, b = fill_to_the_third_block(scheduler, 2)  # 4 of 5 blocks used
    out = step(scheduler)  # a takes the free block; b finds none and is the newest
    assert num_new_tokens(out) == {a: 1}
    assert seq_of(scheduler, a).status is SeqStatus.RUNNING
    assert seq_of(scheduler, b).status is SeqStatus.WAITING
    # once there is room b comes back; its 2 full blocks stayed in the prefix cache, so of its
    # 9 tokens (8 computed before + the sampled one) only the last is recomputed
    scheduler.finish(seq_of(scheduler, a), SeqStatus.FINISHED_STOPPED)
    (s,) = step(scheduler).scheduled
    assert (s.seq.seq_id, s.start_pos, len(s.token_ids)) == (b, 8, 1)


def test_without_prefix_caching_a_recomputed_sequence_runs_all_its_tokens_again() -> None:
    scheduler = make_scheduler(5, enable_prefix_caching=False)
    a, b = fill_to_the_third_block(scheduler, 2)
    step(scheduler)  # b preempts itself, as above
    scheduler.finish(seq_of(scheduler, a), SeqStatus.FINISHED_STOPPED)
    assert num_new_tokens(step(scheduler)) == {b: 9}


@pytest.mark.parametrize(
    ("num_host_blocks", "status", "counter"),
    [
        (2, SeqStatus.SWAPPED, "preemptions_swap"),  # the victim's 2 blocks fit the host tier
        (1, SeqStatus.WAITING, "preemptions_recompute"),  # they do not: recompute instead
        (0, SeqStatus.WAITING, "preemptions_recompute"),
    ],
)
def test_swap_falls_back_to_recompute_when_the_host_tier_is_full(
    num_host_blocks: int, status: SeqStatus, counter: str
) -> None:
    scheduler = make_scheduler(6, preemption_mode="swap", num_host_blocks=num_host_blocks)
    *_, e = fill_to_the_third_block(scheduler, 3)
    out = step(scheduler)
    victim = seq_of(scheduler, e)
    assert out.num_preempted == 1 and victim.status is status
    assert getattr(scheduler.counters, counter) == 1
    assert scheduler.counters.preemptions_swap + scheduler.counters.preemptions_recompute == 1
    if status is SeqStatus.SWAPPED:
        assert len(out.swap_out) == 2 and victim.num_computed_tokens == 8
    else:
        assert out.swap_out == [] and victim.num_computed_tokens == 0
        assert scheduler.kv.host.num_used_blocks == 0


def test_idle_session_pins_are_released_before_anyone_is_preempted() -> None:
    scheduler = make_scheduler(6)
    chat = make_seq(7, session_id="s")
    scheduler.add(chat)
    step(scheduler)
    scheduler.finish(chat, SeqStatus.FINISHED_STOPPED)
    assert scheduler.kv.num_pinned_blocks == 2
    a, b = add(scheduler, 7, 7)
    step(scheduler)  # 2 pinned + 4 running: the pool is full
    out = step(scheduler)
    assert num_new_tokens(out) == {a: 1, b: 1}
    out = step(scheduler)  # a and b each need a third block: the pin goes, nobody is preempted
    assert num_new_tokens(out) == {a: 1, b: 1}
    assert out.num_preempted == 0
    assert scheduler.kv.sessions == {} and scheduler.kv.num_pinned_blocks == 0


def test_a_waiting_sequence_waits_for_room_and_never_preempts() -> None:
    scheduler = make_scheduler(4)
    a, b = add(scheduler, 7, 7)
    step(scheduler)  # all 4 blocks used
    late = make_seq(3)
    scheduler.add(late)
    out = step(scheduler)
    assert num_new_tokens(out) == {a: 1, b: 1} and out.num_preempted == 0
    assert list(scheduler.waiting) == [late] and not scheduler.kv.has_blocks(late.seq_id)


# ---------------------------------------------------------------------- finish


@pytest.mark.parametrize("queue", ["waiting", "running", "swapped"])
def test_finishing_a_sequence_in_any_queue_frees_what_it_holds(queue: str) -> None:
    mode = "recompute" if queue == "waiting" else "swap"
    scheduler = make_scheduler(6, preemption_mode=mode, num_host_blocks=6)
    *_, e = fill_to_the_third_block(scheduler, 3)
    if queue != "running":
        step(scheduler)  # e is preempted: requeued (recompute) or swapped out
    seq = seq_of(scheduler, e)
    assert seq in getattr(scheduler, queue)
    scheduler.finish(seq, SeqStatus.FINISHED_ABORTED)
    assert seq.status is SeqStatus.FINISHED_ABORTED
    assert seq not in [*scheduler.running, *scheduler.swapped, *scheduler.waiting]
    assert not scheduler.kv.has_blocks(e) and e not in scheduler.kv.swapped
    scheduler.kv.check_invariants()


# ------------------------------------------------------------ admission errors


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "num_blocks", "code"),
    [
        ([], 1, 16, "empty_prompt"),
        ([100], 1, 16, "invalid_params"),  # the vocabulary is 0..99
        ([-1], 1, 16, "invalid_params"),
        ([1.0], 1, 16, "invalid_params"),
        (list(range(64)), None, 16, "prompt_too_long"),  # max_model_len 64: no room to generate at all
        (list(range(64)), 1, 16, "prompt_too_long"),
        (list(range(60)), 5, 16, "prompt_too_long"),
        (list(range(30)), 3, 8, "exceeds_pool"),  # 33 tokens need 9 blocks of 4; the pool has 8
    ],
)
def test_admission_refuses_requests_that_cannot_run(
    prompt: list[int], max_tokens: int | None, num_blocks: int, code: str
) -> None:
    with pytest.raises(EngineError) as info:
        validate(prompt, SamplingParams(max_tokens=max_tokens), num_blocks=num_blocks)
    assert info.value.code == code


def test_admission_accepts_what_exactly_fits() -> None:
    assert validate(list(range(60)), SamplingParams(max_tokens=4), num_blocks=16) == 4
    assert validate(list(range(10)), SamplingParams(), num_blocks=16) == 54  # max_tokens defaults to the room left
    assert validate(list(range(63)), SamplingParams(), num_blocks=16) == 1
    assert validate(list(range(30)), SamplingParams(max_tokens=2), num_blocks=8) == 2  # 32 tokens, 8 blocks
