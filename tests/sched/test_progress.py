"""Scheduler progress (issue #15, items 1-2): no deadlock behind a session's next turn,
no livelock of a resumed request; model-free over the real KVCacheManager, then on the tiny model."""

from __future__ import annotations

import pytest

from streamkv.engine_core import EngineCore
from streamkv.errors import EngineError
from streamkv.model.loader import LoadedModel
from streamkv.outputs import RequestOutput, RequestSink
from tests.engine_helpers import assert_pool_whole, greedy, make_llm, prompts_of
from tests.sched.sched_driver import SchedulerDriver, tokens

# SchedulerConfig.max_preemptions' default: the most times one sequence is preempted
MAX_PREEMPTIONS = 2


def _wedge_setup(d: SchedulerDriver) -> tuple[list[int], list[int]]:
    """Session turn 1 pins 10 of 20 blocks; a running request leaves 3 free; the next turn arrives.

    The next turn needs 4 blocks beyond its pin; the running request then
    grows past what is free and, alone in ``running``, preempts itself.
    Each request fits the pool alone.
    """
    d.add("turn-1", tokens(100, 1), 50, session_id="s")
    d.run(200)
    assert len(d.kv.sessions["s"].blocks) == 10
    history = d.finished[-1].seqs[0].token_ids
    d.add("other", tokens(100, 2), 100)
    for _ in range(10):
        d.step()
    assert d.kv.pool.num_free_blocks == 3
    turn_2 = history + tokens(60, 3)
    d.add("turn-2", turn_2, 100, session_id="s")
    return history, turn_2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_next_turn_that_cannot_allocate_holds_no_blocks(mode: str) -> None:
    d = SchedulerDriver(20, preemption_mode=mode)
    d.check_waiting = False  # the end state is the claim here; the next test checks every step
    _wedge_setup(d)
    d.run(1000)  # on the old scheduler: running 0, waiting 2 (swap: waiting 1, swapped 1) forever
    assert sorted(r.request_id for r in d.finished) == ["other", "turn-1", "turn-2"]
    assert all(r.seqs[0].num_output_tokens == 100 for r in d.finished[1:])
    d.release_session("s")
    d.assert_pool_whole()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_waiting_sequences_never_hold_blocks(mode: str) -> None:
    d = SchedulerDriver(20, preemption_mode=mode)
    _wedge_setup(d)
    d.run(1000)  # the driver asserts after every step that no waiting sequence holds a block
    d.release_session("s")
    d.assert_pool_whole()


def test_failed_adoption_keeps_the_pin_or_releases_it_whole() -> None:
    """A next turn that cannot get its blocks hands them back: to the pin, or (when the
    scheduler must unpin for room) released with its full blocks still cached."""
    d = SchedulerDriver(20)
    _wedge_setup(d)
    d.step()
    seq = d.requests["turn-2"].seqs[0]
    assert seq.status.value == "waiting" and seq.num_computed_tokens == 0
    assert not d.kv.has_blocks(seq.seq_id)
    assert "s" not in d.kv.sessions  # unpinned for room: this pool holds no other pin
    assert d.kv.num_pinned_blocks == 0
    assert d.kv.pool.state_counts()["cached"] >= 9  # its full blocks stay reusable
    d.kv.check_invariants()


def test_resumed_request_is_not_preempted_again_and_again() -> None:
    """No prefix caching, recompute, 8 blocks, budget 16: two 40-token prompts of 80 tokens each.

    The old scheduler preempted the second one 18 times and computed 550
    prompt tokens for 80. The bound: a sequence is preempted at most
    ``max_preemptions`` times, so at most (1 + bound) x its tokens are computed.
    """
    d = SchedulerDriver(8, enable_prefix_caching=False, max_num_batched_tokens=16)
    d.add("a", tokens(40, 1), 80)
    d.add("b", tokens(40, 2), 80)
    d.run(2000)
    assert [r.seqs[0].num_output_tokens for r in d.finished] == [80, 80]
    preemptions = [r.seqs[0].num_preemptions for r in d.finished]
    assert max(preemptions) <= MAX_PREEMPTIONS, preemptions
    c = d.scheduler.counters
    assert c.computed_prompt_tokens <= (1 + MAX_PREEMPTIONS) * 80, c
    d.assert_pool_whole()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemptions_per_sequence_are_bounded_under_pressure(mode: str) -> None:
    d = SchedulerDriver(12, enable_prefix_caching=False, max_num_batched_tokens=16, preemption_mode=mode)
    for i in range(6):
        d.add(f"r{i}", tokens(30 + 7 * i, i), 60)
    d.run(5000)
    assert len(d.finished) == 6
    assert d.max_preemptions_seen <= MAX_PREEMPTIONS
    d.assert_pool_whole()


# ------------------------------------------------------------ the engine, tiny model


def _run_core(core: EngineCore, max_steps: int) -> None:
    for _ in range(max_steps):
        if not core.has_work():
            return
        core.step()
        core.check_invariants()
    raise AssertionError(
        f"no finish within {max_steps} steps: running {len(core.scheduler.running)}, "
        f"waiting {len(core.scheduler.waiting)}, swapped {len(core.scheduler.swapped)}"
    )


def _collect(store: dict[str, list[int]], rid: str) -> RequestSink:
    def sink(out: RequestOutput | EngineError) -> None:
        if isinstance(out, EngineError):  # the engine failed the request: fail the test with its error
            raise out
        for d in out.deltas:
            store.setdefault(rid, []).extend(d.token_ids)

    return sink


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_next_turn_under_pressure_finishes_with_greedy_output(tiny: LoadedModel, mode: str) -> None:
    """Item 1 end to end: the 20-block wedge on EngineCore, and the answers equal solo runs."""
    first, other, new_turn = prompts_of([100, 100, 60], seed=5)
    solo = make_llm(tiny)
    turn_1_out = solo.generate([first], greedy(50))[0].outputs[0].token_ids
    turn_2 = first + turn_1_out + new_turn
    ref_turn_2, ref_other = (o.outputs[0].token_ids for o in solo.generate([turn_2, other], greedy(100)))

    llm = make_llm(tiny, num_blocks=20, preemption_mode=mode)
    core = llm.core
    got: dict[str, list[int]] = {}
    core.add_request("turn-1", first, greedy(50), _collect(got, "turn-1"), session_id="s")
    _run_core(core, 200)
    assert got["turn-1"] == turn_1_out
    core.add_request("other", other, greedy(100), _collect(got, "other"))
    for _ in range(10):
        core.step()
    assert core.kv.pool.num_free_blocks == 3
    core.add_request("turn-2", turn_2, greedy(100), _collect(got, "turn-2"), session_id="s")
    _run_core(core, 1000)  # the old scheduler spun here with running 0 and no request finishing
    assert got["other"] == ref_other
    assert got["turn-2"] == ref_turn_2
    core.release_session("s")
    assert_pool_whole(llm)


def test_engine_resumed_request_keeps_greedy_output_and_the_bound(tiny: LoadedModel) -> None:
    """Item 2 end to end: no prefix caching, recompute, 8 blocks, budget 16 (the old scheduler
    preempted one request 18 times); the answers equal solo runs."""
    prompts = prompts_of([40, 40], seed=6)
    ref = [o.outputs[0].token_ids for o in make_llm(tiny).generate(prompts, greedy(80))]
    llm = make_llm(tiny, num_blocks=8, max_num_batched_tokens=16, enable_prefix_caching=False)
    got: dict[str, list[int]] = {}
    reqs = [llm.core.add_request(f"r{i}", p, greedy(80), _collect(got, f"r{i}")) for i, p in enumerate(prompts)]
    _run_core(llm.core, 2000)
    assert [got["r0"], got["r1"]] == ref
    assert max(r.seqs[0].num_preemptions for r in reqs) <= MAX_PREEMPTIONS
    c = llm.core.scheduler.counters
    assert 0 < c.preemptions_recompute and c.computed_prompt_tokens <= (1 + MAX_PREEMPTIONS) * 80
    assert_pool_whole(llm)


def test_max_preemptions_must_allow_one_preemption() -> None:
    from streamkv.config import SchedulerConfig

    assert SchedulerConfig().max_preemptions == MAX_PREEMPTIONS
    with pytest.raises(ValueError, match="max_preemptions must be at least 1"):
        SchedulerConfig(max_preemptions=0)
