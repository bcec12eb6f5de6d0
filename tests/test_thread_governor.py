"""The thread governor: one torch thread while the engine thread waits for a core, every thread once cores are free."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from functools import partial

import pytest
import torch

import streamkv.engine as engine_module
import streamkv.engine_core as engine_core_module
from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.metrics import EngineMetrics
from streamkv.model.loader import LoadedModel
from streamkv.sampling_params import SamplingParams
from streamkv.thread_governor import ThreadGovernor, idle_cpu_seconds, thread_schedstat


class Host:
    """What the governor reads, driven by the test: a clock, the engine thread's schedstat and the idle CPUs."""

    def __init__(self) -> None:
        self.t = 0.0
        self.on_cpu = self.wait = self.idle = 0.0
        self.set: list[int] = []

    def advance(self, seconds: float, *, waiting: float = 0.0, idle_cpus: float = 0.0) -> None:
        """``seconds`` of steps in which the engine thread waited ``waiting`` of its busy time for a core."""
        self.t += seconds
        self.on_cpu += seconds * (1 - waiting)
        self.wait += seconds * waiting
        self.idle += seconds * idle_cpus

    def governor(self, threads: int = 2, *, baseline: bool = True, **kwargs: float) -> ThreadGovernor:
        g = ThreadGovernor(threads, self.set.append, clock=lambda: self.t, schedstat=lambda: (self.on_cpu, self.wait),
                           idle_seconds=lambda: self.idle, **kwargs)  # fmt: skip
        if baseline:
            g.after_step()  # the first call takes the baseline
        return g

    def dropped_governor(self) -> ThreadGovernor:
        """A governor that has just dropped to one thread: a 0.6 s window of steps waiting half their time."""
        g = self.governor()
        self.advance(0.6, waiting=0.5)
        g.after_step()
        assert g.current == 1
        return g


def test_it_drops_to_one_thread_when_the_engine_thread_waits_for_a_core() -> None:
    host = Host()
    g = host.governor()
    host.advance(0.4, waiting=0.9)
    g.after_step()
    assert host.set == [] and g.current == 2  # the window (0.5 s) is not over
    host.advance(0.2, waiting=0.9)
    g.after_step()
    assert host.set == [1] and g.current == 1 and g.drops == 1


def test_started_its_first_step_is_judged_and_an_idle_wait_before_it_is_not() -> None:
    """``start`` takes the baseline before the first step: one long step beside a busy process is a full window
    (without it, that step would only be the baseline), and an idle wait before it stays out."""
    host = Host()
    g = host.governor(baseline=False)
    g.start()
    g.pause()
    host.t += 5.0  # idle: nothing on the engine thread, the cores free
    host.idle += 10.0
    g.resume()
    host.advance(1.1, waiting=0.5)  # one step of the collapse
    g.after_step()
    assert host.set == [1] and g.drops == 1
    unstarted = Host()
    g = unstarted.governor(baseline=False)
    unstarted.advance(1.1, waiting=0.5)
    g.after_step()
    assert unstarted.set == []  # that step only took the baseline

def test_the_callers_own_work_between_calls_stays_out_of_the_window() -> None:
    """Between two ``generate`` calls (paused) the caller's thread may compute for seconds with no wait: that is
    not a step, so it must not dilute the next call's share (a busy process then still drops the threads)."""
    host = Host()
    g = host.governor()
    host.advance(0.3, waiting=0.5)
    g.after_step()
    g.pause()
    host.advance(5.0)  # the caller tokenizes, on its core, no wait
    g.resume()
    host.advance(0.3, waiting=0.5)
    g.after_step()
    assert host.set == [1]

def test_it_keeps_every_thread_on_a_quiet_host_or_with_too_little_busy_time() -> None:
    host = Host()
    g = host.governor()
    for _ in range(10):
        host.advance(0.6, waiting=0.1)  # a little waiting (the server's own event loop)
        g.after_step()
    host.t += 0.6  # a window of mostly idle time: 0.05 s busy, all of it waiting
    host.wait += 0.05
    g.after_step()
    assert host.set == [] and g.current == 2 and g.drops == 0


def test_it_restores_every_thread_once_the_cores_are_free_after_the_hold() -> None:
    host = Host()
    g = host.dropped_governor()
    for _ in range(3):  # 1.8 s: the cores are free, but the hold (2 s) is not over
        host.advance(0.6, idle_cpus=1.0)
        g.after_step()
    assert g.current == 1
    host.advance(0.6, idle_cpus=0.3)  # past the hold, but the other process still takes the second core
    g.after_step()
    assert g.current == 1
    host.advance(0.6, idle_cpus=0.9)
    g.after_step()
    assert host.set == [1, 2] and g.current == 2


def test_an_idle_engine_does_not_bring_the_threads_back_beside_a_busy_process() -> None:
    """After the engine sat idle, that gap's idle CPUs say nothing of the other process: only a window of steps does."""
    host = Host()
    g = host.dropped_governor()
    host.t += 30.0  # no requests for 30 s: the busy process holds one core, the other is idle
    host.idle += 30.0
    g.after_step()
    assert g.current == 1
    host.advance(0.6, idle_cpus=0.05)  # steps again: both cores busy
    g.after_step()
    assert g.current == 1
    host.advance(0.6, idle_cpus=0.9)  # the other process has gone
    g.after_step()
    assert g.current == 2 and host.set == [1, 2]


def test_an_idle_gap_on_free_cores_brings_the_threads_back_before_the_next_burst() -> None:
    """Idle with every core free (the other process gone): the threads are back at resume, before the next step.
    Idle beside a busy process (one core of two idle), too short a gap, or within the hold: they are not."""
    host = Host()
    g = host.dropped_governor()
    for gap, idle_cpus in ((30.0, 1.0), (0.2, 2.0)):  # beside a busy process; a gap too short to judge
        g.pause()
        host.t += gap
        host.idle += gap * idle_cpus
        g.resume()
        assert g.current == 1
    g.pause()
    host.t += 5.0  # the other process has gone: both cores idle
    host.idle += 10.0
    g.resume()
    assert g.current == 2 and host.set == [1, 2]
    host.advance(0.6, waiting=0.5)  # it comes back at once: a quick drop doubles the hold
    g.after_step()
    assert g.current == 1 and g.hold_s == 4.0
    g.pause()
    host.t += 3.0  # idle on free cores, but within the 4 s hold
    host.idle += 6.0
    g.resume()
    assert g.current == 1

def test_a_quick_drop_after_a_restore_doubles_the_hold_and_a_lasting_restore_resets_it() -> None:
    host = Host()
    g = host.governor(max_hold_s=6.0)

    def drop_then_restore(waited_before_restore: float) -> None:
        host.advance(0.6, waiting=0.5)
        g.after_step()
        assert g.current == 1
        host.advance(waited_before_restore, idle_cpus=1.0)
        g.after_step()
        assert g.current == 2

    drop_then_restore(2.0)
    assert g.hold_s == 2.0
    drop_then_restore(4.0)  # dropped again in the first window after the restore: the hold doubles
    assert g.hold_s == 4.0
    drop_then_restore(6.0)
    assert g.hold_s == 6.0  # capped at max_hold_s
    for _ in range(5):  # a restore that lasts
        host.advance(0.6)
        g.after_step()
    host.advance(0.6, waiting=0.5)
    g.after_step()
    assert g.current == 1 and g.hold_s == 2.0 and g.drops == 4


def test_a_drop_right_after_a_restore_doubles_the_hold_even_when_steps_outlast_the_window() -> None:
    """Beside a busy process a two-thread step can take longer than a window: the re-drop must still count as quick."""
    host = Host()
    g = host.governor()
    holds = []
    for _ in range(3):
        host.advance(1.3, waiting=0.6)  # one collapsed step, longer than the 0.5 s window
        g.after_step()
        assert g.current == 1
        holds.append(g.hold_s)
        host.advance(g.hold_s + 0.1, idle_cpus=1.0)
        g.after_step()
        assert g.current == 2
    assert holds == [2.0, 4.0, 8.0]


def test_short_requests_with_idle_gaps_still_fill_windows_of_steps() -> None:
    """Requests and idle gaps both shorter than a window: the paused gaps stay out, and windows of steps from
    several requests bring the threads back on free cores (the gaps are too short for resume to judge)."""
    host = Host()
    g = host.dropped_governor()
    for _ in range(20):
        g.pause()
        host.t += 0.4  # idle between requests, the cores free (a gap shorter than a window: resume leaves it)
        host.idle += 0.8
        g.resume()
        for _ in range(4):  # a 0.4 s request of 0.1 s steps, one core idle
            host.advance(0.1, idle_cpus=1.0)
            g.after_step()
    assert g.current == 2 and host.set == [1, 2]


@pytest.mark.parametrize("error", [OSError(24, "Too many open files"), ValueError("odd /proc/stat")])
def test_a_reading_that_fails_later_turns_it_off_and_gives_back_the_threads(
    error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    host = Host()
    g = host.dropped_governor()

    def broken() -> tuple[float, float]:
        raise error

    g.schedstat = broken
    host.advance(3.0, idle_cpus=1.0)
    with caplog.at_level(logging.WARNING, logger="streamkv.thread_governor"):
        g.after_step()  # must not raise into the engine thread
    assert not g.enabled and g.current == 2 and host.set == [1, 2] and "thread governor off" in caplog.text
    g.after_step()
    g.pause()
    g.resume()
    assert host.set == [1, 2]


def test_one_thread_or_no_schedstat_turns_it_off(caplog: pytest.LogCaptureFixture) -> None:
    host = Host()
    g = host.governor(threads=1)
    host.advance(1.0, waiting=0.9)
    g.after_step()
    assert not g.enabled and host.set == []

    def no_schedstat() -> tuple[float, float]:
        raise FileNotFoundError(2, "No such file or directory", "/proc/thread-self/schedstat")

    g = ThreadGovernor(2, host.set.append, schedstat=no_schedstat)
    with caplog.at_level(logging.INFO, logger="streamkv.thread_governor"):
        g.after_step()
        g.after_step()
    assert not g.enabled and host.set == [] and "thread governor off" in caplog.text


def test_the_readings_come_from_proc() -> None:
    on_cpu, wait = thread_schedstat()
    t = time.thread_time()
    while time.thread_time() - t < 0.05:  # 50 ms on the CPU
        pass
    later, later_wait = thread_schedstat()
    assert later - on_cpu >= 0.04 and later_wait >= wait >= 0
    assert idle_cpu_seconds() > 0


def force_a_drop_at_every_step(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the engine's governors see the engine thread waiting 90% of its time at every step (so they drop
    once, and hold); returns the list of the thread counts they set, in order."""
    host = Host()
    threads_seen: list[int] = []

    def set_threads(n: int) -> None:
        threads_seen.append(n)
        torch.set_num_threads(n)

    def waits_always() -> tuple[float, float]:  # every reading: 10 ms more, 9 of them waiting
        host.on_cpu += 0.001
        host.wait += 0.009
        return host.on_cpu, host.wait

    forced = partial(ThreadGovernor, period_s=0.0, min_busy_s=0.0, hold_s=1e9, schedstat=waits_always)
    monkeypatch.setattr(engine_core_module, "ThreadGovernor", lambda n, _set, **kw: forced(n, set_threads, **kw))
    return threads_seen


def test_the_served_engine_gives_the_same_tokens_across_a_drop_and_reports_it(
    tiny_model_dir: str, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drop to one thread in the middle of generation changes no token; the gauge and the counter show it."""
    threads_seen = force_a_drop_at_every_step(monkeypatch)
    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"),
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(max_model_len=256),
    )
    prompts = [[101 + i, 202, 303 + 7 * i, 404] * (3 + i) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def run(adaptive: bool) -> tuple[list[list[int]], EngineMetrics]:
        metrics = EngineMetrics()
        engine = engine_module.AsyncEngine(
            EngineConfig(config.model, config.cache, config.scheduler, adaptive_threads=adaptive), metrics, loaded=tiny
        )
        await engine.start()
        try:

            async def one(prompt: list[int]) -> list[int]:
                out: list[int] = []
                async for o in engine.generate(prompt, params):
                    out.extend(t for d in o.deltas for t in d.token_ids)
                return out

            return list(await asyncio.gather(*(one(p) for p in prompts))), metrics
        finally:
            await engine.shutdown()

    threads = torch.get_num_threads()
    try:
        fixed, fixed_metrics = asyncio.run(run(adaptive=False))
        governed, metrics = asyncio.run(run(adaptive=True))
        # the engine thread ended at one thread: threads started later must not begin at one
        later: list[int] = []
        probe = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        probe.start()
        probe.join()
        assert later == [threads]
    finally:
        torch.set_num_threads(threads)
    assert fixed == governed and all(len(t) == 24 for t in fixed)
    if threads > 1:
        assert threads_seen == [1, threads]  # the drop, then every thread given back as the engine thread ends
        assert metrics.registry.get_sample_value("streamkv_engine_threads") == threads
        assert metrics.registry.get_sample_value("streamkv_engine_thread_drops_total") == 1
    assert fixed_metrics.registry.get_sample_value("streamkv_engine_thread_drops_total") == 0
    assert fixed_metrics.registry.get_sample_value("streamkv_engine_threads") == threads


def test_offline_generate_gives_the_same_tokens_across_a_drop_and_gives_the_caller_its_threads_back(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LLM.generate`` steps under its calling thread's governor: a drop changes no token, the counter shows it,
    the caller's thread count is back when generate returns, and the held drop carries over to that thread's next
    call, which still gives the caller its count back when a step raises."""
    from streamkv.llm import LLM

    threads_seen = force_a_drop_at_every_step(monkeypatch)
    prompts = [[101 + i, 202, 303 + 7 * i, 404] * (3 + i) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("needs 2 torch threads")
    fixed = LLM(loaded=tiny, device="cpu", num_blocks=64, max_model_len=256, adaptive_threads=False)
    fixed_tokens = [r.outputs[0].token_ids for r in fixed.generate(prompts, params)]
    assert threads_seen == [] and torch.get_num_threads() == threads
    metrics = EngineMetrics()
    governed = LLM(loaded=tiny, device="cpu", num_blocks=64, max_model_len=256, metrics=metrics)
    governed_tokens = [r.outputs[0].token_ids for r in governed.generate(prompts, params)]
    assert governed_tokens == fixed_tokens and all(len(t) == 24 for t in fixed_tokens)
    assert threads_seen == [1] and torch.get_num_threads() == threads  # the drop, then the caller's count back
    assert metrics.registry.get_sample_value("streamkv_engine_thread_drops_total") == 1
    assert metrics.registry.get_sample_value("streamkv_engine_threads") == 1  # the engine's count, held

    real_step, in_steps = governed.core.step, []

    def step_then_fail() -> bool:  # two steps run, the third raises
        in_steps.append(torch.get_num_threads())
        if len(in_steps) < 3:
            return real_step()
        raise RuntimeError("step failed")

    monkeypatch.setattr(governed.core, "step", step_then_fail)
    with pytest.raises(RuntimeError, match="step failed"):
        governed.generate(prompts[:1], params)
    assert in_steps == [1, 1, 1] and threads_seen == [1]  # held from the first step: no second drop
    assert torch.get_num_threads() == threads


def test_offline_generate_runs_at_the_llms_thread_count_whatever_the_calling_threads_reads(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread that first touched torch during another thread's drop reads one thread; the engine still runs at
    the count of the LLM's construction, and that thread's own count is left as it was."""
    from streamkv.llm import LLM

    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("needs 2 torch threads")
    llm = LLM(loaded=tiny, device="cpu", num_blocks=64, max_model_len=256, adaptive_threads=False)
    real_step, in_steps, after = llm.core.step, [], []
    monkeypatch.setattr(llm.core, "step", lambda: (in_steps.append(torch.get_num_threads()), real_step())[1])

    def other_thread() -> None:
        torch.set_num_threads(1)
        llm.generate([[101, 202, 303, 404] * 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        after.append(torch.get_num_threads())

    try:
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(threads)
    assert in_steps and set(in_steps) == {threads} and after == [1]
