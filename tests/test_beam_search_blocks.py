"""Beam search on the tiny model: beams share blocks, fork copy-on-write, free when pruned.

The real-model comparison with transformers is ``tests/test_beam_search_truth.py``;
here every variant (a split batch, preemption, a mixed batch) is held to the
engine's own unconstrained run, and the pool's books are checked every step.
"""

from __future__ import annotations

import pytest
from engine_helpers import assert_pool_whole, greedy, make_llm, prompts_of

from streamkv.cache.kv_cache_manager import cdiv
from streamkv.errors import EngineError, ErrorCode
from streamkv.llm import LLM
from streamkv.outputs import CompletedRequest, CompletionOutput, RequestOutput
from streamkv.sampling_params import SamplingParams

WIDTH = 4
MAX_TOKENS = 20
PROMPT = prompts_of([37])[0]  # 2 full blocks and a partial one: forks copy the partial block


def beam(width: int = WIDTH, **kw: object) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("n", width)
    return SamplingParams(temperature=0, beam_width=width, **kw)  # type: ignore[arg-type]


def hypotheses(res: CompletedRequest) -> list[tuple[list[int], float | None, str | None]]:
    return [(o.token_ids, o.score, o.finish_reason) for o in res.outputs]


def assert_same_hypotheses(got: CompletedRequest, want: list[tuple[list[int], float | None, str | None]]) -> None:
    """The same beams (tokens, finish reasons, order) with the same scores, to fp32 rounding.

    A prefill chunk of one row attends through the decode kernel, and on an AVX-512 build that kernel sums in
    another order than the prefill kernel's: a score then differs from the unsplit run's in its last bits
    (1e-7 relative), never in its tokens.
    """
    mine = hypotheses(got)
    assert [(t, f) for t, _, f in mine] == [(t, f) for t, _, f in want]
    assert [s for _, s, _ in mine] == pytest.approx([s for _, s, _ in want], rel=1e-5)


@pytest.fixture(scope="module")
def reference(tiny) -> list[tuple[list[int], float | None, str | None]]:
    llm = make_llm(tiny)
    (res,) = llm.generate([PROMPT], beam(ignore_eos=True))
    assert_pool_whole(llm)
    return hypotheses(res)


def run_stepwise(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[CompletedRequest, list[tuple[int, int]]]:
    """Run one request step by step; per step (physical blocks held, blocks of one beam's length)."""
    res = CompletedRequest("r", prompt, [CompletionOutput(i) for i in range(params.n)])
    outs: list[RequestOutput] = []
    llm.core.add_request("r", prompt, params, outs.append)
    seen = []
    while llm.core.has_work():
        llm.core.step()
        llm.core.check_invariants()  # ref counts equal the references live beams and pins hold
        core = llm.core
        group = core.beams.groups.get("r")
        if group is not None:
            physical = core.num_blocks - core.kv.num_free_blocks
            logical = cdiv(group.beams[0].seq.num_tokens, core.block_size)
            seen.append((physical, logical))
    for out in outs:
        for d in out.deltas:
            o = res.outputs[d.index]
            o.token_ids += d.token_ids
            o.text += d.text
            o.finish_reason, o.score = d.finish_reason, d.score
    assert outs[-1].finished and len(outs) == 1  # beam search sends its hypotheses once, at the end
    return res, seen


def test_beams_share_blocks_and_free_pruned_ones(tiny, reference) -> None:
    llm = make_llm(tiny, enable_prefix_caching=False)  # no cached block may hide a leak
    res, seen = run_stepwise(llm, PROMPT, beam(ignore_eos=True))
    assert_same_hypotheses(res, reference)
    assert len(seen) >= MAX_TOKENS - 1
    for physical, logical in seen[1:]:  # from the first fork on: WIDTH live beams
        assert physical < WIDTH * logical, (physical, logical)
    # the prompt's two full blocks are held once for all beams: at most WIDTH partial-block copies
    # plus the blocks the beams grew past the prompt
    peak, logical_at_peak = max(seen)
    assert peak <= 2 + WIDTH * (logical_at_peak - 2), seen
    assert llm.core.kv.pool.counters.cow_copies > 0  # forks diverged inside a shared block
    assert_pool_whole(llm)


def test_output_shape(tiny, reference) -> None:
    scores = [s for _, s, _ in reference]
    assert scores == sorted(scores, reverse=True)  # best first
    assert all(len(t) == MAX_TOKENS and r == "length" for t, _, r in reference)  # ignore_eos: all reach max_tokens
    assert len({tuple(t) for t, _, _ in reference}) == WIDTH  # distinct hypotheses


@pytest.mark.parametrize("options", [{"max_num_seqs": 3}, {"max_num_batched_tokens": 2}], ids=["seqs", "budget"])
def test_beams_split_over_steps_give_the_same_hypotheses(tiny, reference, options) -> None:
    llm = make_llm(tiny, **options)
    (res,) = llm.generate([PROMPT], beam(ignore_eos=True))
    assert_same_hypotheses(res, reference)
    assert_pool_whole(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_hypotheses(tiny, reference, mode) -> None:
    # 16 blocks: the beam request fits alone (4 x 4 blocks); two greedy neighbours force preemptions
    llm = make_llm(tiny, num_blocks=16, preemption_mode=mode, swap_space=1 << 24)
    others = prompts_of([50, 45], seed=3)  # 6 blocks each by the end
    outs = llm.generate([PROMPT, *others], [beam(ignore_eos=True), greedy(40), greedy(40)])
    sched = llm.core.scheduler.counters
    assert sched.preemptions_recompute + sched.preemptions_swap > 0
    assert_same_hypotheses(outs[0], reference)
    alone = make_llm(tiny).generate(others, greedy(40))
    assert [o.outputs[0].token_ids for o in outs[1:]] == [o.outputs[0].token_ids for o in alone]
    assert_pool_whole(llm)


def test_greedy_neighbours_are_unchanged(tiny, reference) -> None:
    others = prompts_of([5, 40, 17], seed=7)
    want = make_llm(tiny).generate(others, greedy(16))
    llm = make_llm(tiny, max_num_batched_tokens=32)
    outs = llm.generate([*others[:2], PROMPT, others[2]], [greedy(16), greedy(16), beam(ignore_eos=True), greedy(16)])
    assert_same_hypotheses(outs[2], reference)
    got = [outs[0], outs[1], outs[3]]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert_pool_whole(llm)


def test_n_best_are_the_head_of_the_width(tiny, reference) -> None:
    (res,) = make_llm(tiny).generate([PROMPT], beam(n=2, ignore_eos=True))
    assert_same_hypotheses(res, reference[:2])


def test_width_one_is_greedy(tiny) -> None:
    (want,) = make_llm(tiny).generate([PROMPT], greedy(MAX_TOKENS))
    (res,) = make_llm(tiny).generate([PROMPT], beam(1, ignore_eos=True))
    assert res.outputs[0].token_ids == want.outputs[0].token_ids


def test_stop_token_ends_a_hypothesis(tiny, reference) -> None:
    stop = reference[0][0][5]  # the best hypothesis' 6th token
    (res,) = make_llm(tiny).generate([PROMPT], beam(ignore_eos=True, stop_token_ids=(stop,)))
    stopped = [o for o in res.outputs if o.finish_reason == "stop"]
    assert stopped and all(o.token_ids[-1] == stop and stop not in o.token_ids[:-1] for o in stopped)
    assert all(stop not in o.token_ids for o in res.outputs if o.finish_reason == "length")
    (late,) = make_llm(tiny).generate([PROMPT], beam(ignore_eos=True, stop_token_ids=(stop,), min_tokens=MAX_TOKENS))
    assert all(stop not in o.token_ids[:-1] for o in late.outputs)


def test_abort_mid_search_frees_every_block(tiny) -> None:
    llm = make_llm(tiny)
    outs: list[RequestOutput] = []
    llm.core.add_request("r", PROMPT, beam(ignore_eos=True), outs.append)
    for _ in range(6):
        llm.core.step()
    assert llm.core.abort("r")
    assert not llm.core.has_work() and not llm.core.beams.groups
    (out,) = outs
    assert out.finished and [d.finish_reason for d in out.deltas] == ["cancelled"] * WIDTH
    assert all(len(d.token_ids) == 6 for d in out.deltas)  # the best beams so far: a token per step
    assert out.usage is not None and out.usage.completion_tokens == 6 * WIDTH
    assert_pool_whole(llm)


def test_session_keeps_the_best_beam(tiny) -> None:
    llm = make_llm(tiny)
    (res,) = llm.generate([PROMPT], beam(ignore_eos=True), session_ids=["s"])
    pin = llm.core.kv.sessions.get("s")
    assert pin is not None
    best = PROMPT + res.outputs[0].token_ids
    assert pin.token_ids == best[: len(pin.token_ids)] and len(pin.token_ids) > len(PROMPT)
    follow = best + prompts_of([6], seed=9)[0]
    (turn2,) = llm.generate([follow], greedy(4), session_ids=["s"])
    assert turn2.usage is not None and turn2.usage.cached_tokens == len(pin.token_ids)
    llm.core.release_session("s")
    assert_pool_whole(llm)


def test_refusals(tiny) -> None:
    with pytest.raises(ValueError, match="^n "):
        beam(2, n=3)
    with pytest.raises(ValueError, match="^stop "):
        beam(stop=["x"])
    with pytest.raises(ValueError, match="^logprobs "):
        beam(logprobs=1)
    with pytest.raises(ValueError, match="^beam_width "):
        beam(17, n=1)
    with pytest.raises(ValueError, match="^early_stopping "):
        beam(early_stopping="sometimes")  # type: ignore[arg-type]
    llm = make_llm(tiny, num_blocks=12)
    with pytest.raises(EngineError) as err:  # 4 beams x 4 blocks could need more than 12
        llm.generate([PROMPT], beam())
    assert err.value.code is ErrorCode.EXCEEDS_POOL
    assert_pool_whole(llm)
