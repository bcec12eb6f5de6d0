"""Engine-level invariants on a tiny random Llama: greedy output is independent
of batch mix, chunk size, prefix hits and preemption; the pool comes back whole."""

from __future__ import annotations

import pytest

from streamkv.errors import EngineError
from streamkv.sampling_params import SamplingParams
from tests.engine_helpers import assert_pool_whole, greedy, make_llm, prompts_of

LENGTHS = [5, 16, 23, 40, 70]


@pytest.fixture(scope="module")
def reference(tiny):
    """Each prompt run alone with an unlimited budget and no prefix caching."""
    llm = make_llm(tiny, max_num_batched_tokens=4096, enable_prefix_caching=False)
    return [llm.generate([p], greedy())[0].outputs[0].token_ids for p in prompts_of(LENGTHS)]


@pytest.mark.parametrize("budget", [1, 7, 16, 17, 33, 64, 4096])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_is_independent_of_chunking_and_batch_mix(tiny, reference, budget, prefix_caching):
    llm = make_llm(tiny, max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching)
    outs = llm.generate(prompts_of(LENGTHS), greedy())
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_pool_whole(llm)


def test_long_prompt_chunked_while_others_decode(tiny, reference):
    llm = make_llm(tiny, max_num_batched_tokens=17)
    prompts = prompts_of(LENGTHS)
    # the short ones start decoding before the 70-token prompt's chunks finish
    outs = llm.generate(prompts, greedy())
    assert [o.outputs[0].token_ids for o in outs] == reference


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_output(tiny, mode):
    prompts = prompts_of([30, 34, 28, 40, 25, 33], seed=1)
    ref = make_llm(tiny).generate(prompts, greedy(40))
    llm = make_llm(tiny, num_blocks=12, preemption_mode=mode, max_num_batched_tokens=64)
    outs = llm.generate(prompts, greedy(40))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    c = llm.core.scheduler.counters
    assert (c.preemptions_swap if mode == "swap" else c.preemptions_recompute) > 0
    assert_pool_whole(llm)


def test_seeded_sampling_survives_batch_mix_and_preemption(tiny):
    prompts = prompts_of([30, 34, 28, 40], seed=2)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True)
    other = SamplingParams(temperature=0.8, top_p=0.9, seed=99, max_tokens=30, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    alone = make_llm(tiny).generate([prompts[0]], seeded)[0].outputs[0].token_ids
    mixed = make_llm(tiny).generate(prompts, [seeded, unseeded, other, unseeded])
    assert mixed[0].outputs[0].token_ids == alone
    for mode in ("recompute", "swap"):
        tight = make_llm(tiny, num_blocks=9, preemption_mode=mode)
        outs = tight.generate(prompts, [seeded, unseeded, other, unseeded])
        assert outs[0].outputs[0].token_ids == alone
        assert tight.core.scheduler.counters.preemptions_recompute + tight.core.scheduler.counters.preemptions_swap > 0
        assert_pool_whole(tight)


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_max_tokens_exact(tiny, max_tokens):
    llm = make_llm(tiny)
    (out,) = llm.generate(prompts_of([9]), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == max_tokens
    assert out.outputs[0].finish_reason == "length"
    assert out.usage.completion_tokens == max_tokens


@pytest.mark.parametrize("length, cached", [(15, 0), (16, 0), (17, 16), (31, 16), (32, 16), (33, 32)])
def test_prefix_cache_hits_whole_blocks_and_keeps_output(tiny, length, cached):
    llm = make_llm(tiny)
    (prompt,) = prompts_of([length], seed=length)
    first = llm.generate([prompt], greedy(8))[0]
    second = llm.generate([prompt], greedy(8))[0]
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == cached
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert_pool_whole(llm)


def test_evicted_prefix_recomputes_identically(tiny):
    llm = make_llm(tiny, num_blocks=8)
    (prompt,) = prompts_of([40], seed=5)
    first = llm.generate([prompt], greedy(8))[0]
    llm.generate(prompts_of([118], seed=6), greedy(8))  # 126 tokens need all 8 blocks: evicts the first prompt's
    again = llm.generate([prompt], greedy(8))[0]
    assert llm.core.kv.pool.counters.evictions > 0
    assert again.usage.cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_parallel_sampling_shares_prompt_blocks(tiny):
    llm = make_llm(tiny)
    core = llm.core
    (prompt,) = prompts_of([37], seed=3)
    params = SamplingParams(n=4, temperature=0.8, seed=11, max_tokens=10, ignore_eos=True)
    outs = []
    core.add_request("r", prompt, params, outs.append)
    while not any(r.forked for r in core.requests.values()):
        core.step()
    req = core.requests["r"]
    shared = core.kv.seq_blocks[req.seqs[0].seq_id][:2]  # the two full prompt blocks
    assert [b.ref_cnt for b in shared] == [4, 4]
    core.check_invariants()
    while core.has_work():
        core.step()
    texts = {}
    for out in outs:
        for d in out.deltas:
            texts.setdefault(d.index, []).extend(d.token_ids)
    assert len(texts) == 4 and len({tuple(t) for t in texts.values()}) == 4
    assert core.kv.pool.counters.cow_copies >= 3  # the partial third block, copied per writer
    assert_pool_whole(llm)


def test_greedy_n2_gives_identical_samples(tiny):
    (out,) = make_llm(tiny).generate(prompts_of([20]), SamplingParams(n=2, temperature=0, max_tokens=8))
    assert out.outputs[0].token_ids == out.outputs[1].token_ids


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_parallel_sampling_under_preemption(tiny, mode):
    prompts = prompts_of([37, 30, 45], seed=8)
    params = [SamplingParams(n=4, temperature=0.8, seed=5, max_tokens=24, ignore_eos=True), greedy(24), greedy(24)]
    ref = make_llm(tiny).generate(prompts, params)
    llm = make_llm(tiny, num_blocks=14, preemption_mode=mode, max_num_batched_tokens=32)
    outs = llm.generate(prompts, params)
    for a, b in zip(ref, outs, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    c = llm.core.scheduler.counters
    assert c.preemptions_recompute + c.preemptions_swap > 0
    assert_pool_whole(llm)


def test_session_pin_computes_only_new_tokens(tiny):
    llm = make_llm(tiny)
    history = prompts_of([21], seed=9)[0]
    pinned_tokens = 0  # the pin's length after the previous turn (read from turn 1 on)
    for turn in range(4):
        before = llm.core.scheduler.counters.computed_prompt_tokens
        out = llm.generate([history], greedy(7), session_ids=["s"])[0]
        computed = llm.core.scheduler.counters.computed_prompt_tokens - before
        fresh = make_llm(tiny, enable_prefix_caching=False).generate([history], greedy(7))[0]
        assert out.outputs[0].token_ids == fresh.outputs[0].token_ids
        if turn > 0:
            assert out.usage.cached_tokens == pinned_tokens
            assert computed == len(history) - pinned_tokens
        pinned_tokens = len(history) + 7 - 1  # the last sampled token's KV is computed next turn
        assert llm.core.kv.sessions["s"].token_ids == (history + out.outputs[0].token_ids)[:pinned_tokens]
        history = history + out.outputs[0].token_ids + prompts_of([5 + turn], seed=20 + turn)[0]
        llm.core.check_invariants()
    llm.core.release_session("s")
    assert_pool_whole(llm)


def test_unpinning_comes_before_preemption(tiny):
    llm = make_llm(tiny, num_blocks=12)
    for i in range(3):
        llm.generate(prompts_of([40], seed=30 + i), greedy(4), session_ids=[f"s{i}"])
    assert llm.core.kv.num_pinned_blocks > 0
    llm.generate(prompts_of([150], seed=40), greedy(4))
    assert llm.core.scheduler.counters.preemptions_recompute == 0
    assert len(llm.core.kv.sessions) < 3  # someone was unpinned to make room
    llm.core.check_invariants()


def test_abort_frees_blocks(tiny):
    llm = make_llm(tiny)
    core = llm.core
    outs = []
    core.add_request("a", prompts_of([50])[0], greedy(100), outs.append)
    for _ in range(3):
        core.step()
    assert core.kv.pool.num_free_blocks < core.num_blocks
    core.abort("a")
    assert outs[-1].finished and outs[-1].deltas[-1].finish_reason == "cancelled"
    assert not core.has_work()
    assert_pool_whole(llm)


def test_admission_errors(tiny):
    llm = make_llm(tiny, max_model_len=1024, num_blocks=64)
    core = llm.core
    with pytest.raises(EngineError) as e:
        core.validate([], greedy())
    assert e.value.code == "empty_prompt"
    with pytest.raises(EngineError) as e:
        core.validate(prompts_of([1024])[0], SamplingParams(temperature=0))
    assert e.value.code == "prompt_too_long"
    with pytest.raises(EngineError) as e:
        core.validate(prompts_of([1000])[0], SamplingParams(max_tokens=100))
    assert e.value.code == "prompt_too_long"
    (out,) = llm.generate(prompts_of([1023]), SamplingParams(temperature=0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    small = make_llm(tiny, max_model_len=1024, num_blocks=4)
    with pytest.raises(EngineError) as e:
        small.core.validate(prompts_of([100])[0], SamplingParams(max_tokens=10))
    assert e.value.code == "exceeds_pool"
    (ok,) = small.generate(prompts_of([10]), greedy(5))
    assert len(ok.outputs[0].token_ids) == 5


def test_decode_steps_stay_within_budget(tiny):
    llm = make_llm(tiny, max_num_batched_tokens=16, max_num_seqs=4)
    core = llm.core
    for i, p in enumerate(prompts_of([30, 8, 12, 50, 3, 9], seed=4)):
        core.add_request(str(i), p, greedy(10), lambda out: None)
    while core.has_work():
        out = core.scheduler.schedule()
        assert out.num_batched_tokens <= 16 and len(out.scheduled) <= 4
        for s in out.scheduled:
            table = core.kv.block_table(s.seq.seq_id)
            assert len(table) * 16 >= s.start_pos + len(s.token_ids)
        core.runner.execute(out)
        core.scheduler.update(out)
        # finish everything through the normal path to keep state consistent
        sampled = [s.seq for s in out.scheduled if s.samples]
        core.outputs.process(sampled, [0] * len(sampled), 0.0)
        core.check_invariants()


def test_different_sampling_on_one_prompt_shares_blocks_keeps_outputs(tiny):
    llm = make_llm(tiny)
    (prompt,) = prompts_of([48], seed=12)
    greedy_alone = llm.generate([prompt], greedy(10))[0].outputs[0].token_ids
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True)
    seeded_alone = make_llm(tiny).generate([prompt], seeded)[0].outputs[0].token_ids
    both = llm.generate([prompt, prompt], [greedy(10), seeded])
    assert both[0].usage.cached_tokens == 32 and both[1].usage.cached_tokens == 32  # shared prompt blocks
    assert both[0].outputs[0].token_ids == greedy_alone
    assert both[1].outputs[0].token_ids == seeded_alone
    assert_pool_whole(llm)


@pytest.mark.parametrize("budget", [16, 17, 33])
def test_no_token_streams_before_the_last_chunk(tiny, budget):
    llm = make_llm(tiny, max_num_batched_tokens=budget)
    core = llm.core
    long_prompt, a, b = prompts_of([90, 6, 9], seed=13)
    events = []
    for rid, p in (("a", a), ("b", b)):
        core.add_request(rid, p, greedy(40), lambda out: None)
    core.step()
    req = core.add_request("long", long_prompt, greedy(5), events.append)
    while core.has_work():
        n_events = len(events)
        core.step()
        if len(events) > n_events and events[n_events].deltas and events[n_events].deltas[0].token_ids:
            assert req.seqs[0].num_computed_tokens >= len(long_prompt), "streamed before the prompt was computed"
    ref = make_llm(tiny).generate([long_prompt], greedy(5))[0].outputs[0].token_ids
    assert [t for e in events for d in e.deltas for t in d.token_ids] == ref


def test_snapshot_agrees_with_the_pool(tiny):
    import base64

    llm = make_llm(tiny, num_blocks=40)
    core = llm.core
    for i, p in enumerate(prompts_of([30, 50, 20], seed=14)):
        core.add_request(str(i), p, SamplingParams(n=2, temperature=0.5, seed=i, max_tokens=8), lambda o: None)
    llm.generate(prompts_of([20], seed=15), greedy(4), session_ids=["pinned"])
    for _ in range(4):
        core.step()
        snap = core.snapshot()
        states = base64.b64decode(snap["states"])
        assert len(states) == snap["num_blocks"] == sum(snap["counts"].values())
        assert snap["counts"] == core.kv.pool.state_counts()
        assert states == bytes(core.kv.pool.states)
        assert snap["sessions"]["pinned_blocks"] == core.kv.num_pinned_blocks
        assert 0.0 <= snap["kv_usage"] <= 1.0



def test_scheduler_and_server_load_without_torch():
    """sched/ never touches tensors and server/ talks to a protocol: neither imports torch."""
    import subprocess
    import sys

    code = "import sys, streamkv.sched.scheduler, streamkv.server.app\nassert 'torch' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True)
