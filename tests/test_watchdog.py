"""The progress watchdog (issue #15 item 3): idle steps are noticed, logged once, counted."""

from __future__ import annotations

import logging

import pytest

from streamkv.metrics import EngineMetrics
from streamkv.sched.output import SchedulerOutput
from streamkv.watchdog import Watchdog
from tests.engine_helpers import greedy, make_llm, prompts_of


def test_stall_is_declared_once_after_n_idle_steps_and_clears_on_progress(caplog):
    wd = Watchdog(max_idle_steps=3)
    calls = []

    def describe() -> str:
        calls.append(1)
        return "running 0, waiting 2"

    with caplog.at_level(logging.ERROR, logger="streamkv.watchdog"):
        assert [wd.observe(0, 0, describe) for _ in range(2)] == [False, False]
        assert not wd.stalled
        assert wd.observe(0, 0, describe) is True
        assert wd.stalled and wd.num_stalls == 1
        assert [wd.observe(0, 0, describe) for _ in range(10)] == [False] * 10  # logged once
    assert len(calls) == 1
    stall_logs = [r for r in caplog.records if "stalled" in r.getMessage()]
    assert len(stall_logs) == 1 and "running 0, waiting 2" in stall_logs[0].getMessage()
    wd.observe(5, 0, describe)  # a computed token ends the stall
    assert not wd.stalled and wd.num_idle_steps == 0
    for _ in range(3):
        wd.observe(0, 0, describe)
    assert wd.stalled and wd.num_stalls == 2  # a new stall is a new count
    wd.observe(0, 1, describe)  # a finished request (e.g. a cancel) is progress too
    assert not wd.stalled


def test_watchdog_rejects_a_zero_threshold():
    with pytest.raises(ValueError, match="max_idle_steps"):
        Watchdog(max_idle_steps=0)


def test_engine_counts_a_stall_when_steps_compute_nothing(tiny, caplog, monkeypatch):
    """A scheduler that schedules nothing while work is queued (a wedge) trips the watchdog."""
    metrics = EngineMetrics()
    llm = make_llm(tiny, metrics=metrics)
    core = llm.core
    core.watchdog.max_idle_steps = 5
    (prompt,) = prompts_of([20])
    core.add_request("r", prompt, greedy(4), lambda out: None)
    monkeypatch.setattr(core.scheduler, "schedule", lambda: SchedulerOutput())
    with caplog.at_level(logging.ERROR, logger="streamkv.watchdog"):
        for _ in range(4):
            assert core.step() is False
        assert not core.watchdog.stalled
        core.step()
        assert core.watchdog.stalled
        for _ in range(20):
            core.step()
    logs = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(logs) == 1 and "waiting 1" in logs[0] and "head of waiting: seq" in logs[0], logs
    body = metrics.render()[0].decode()
    assert "streamkv_engine_stalls_total 1.0" in body
    monkeypatch.undo()
    for _ in range(50):  # the real scheduler runs it: progress clears the stall
        if not core.has_work():
            break
        core.step()
    assert not core.has_work() and not core.watchdog.stalled


def test_healthy_engine_never_stalls(tiny):
    llm = make_llm(tiny, num_blocks=12, max_num_batched_tokens=16)
    llm.core.watchdog.max_idle_steps = 1  # any step without progress would count
    llm.generate(prompts_of([30, 34, 28, 40], seed=3), greedy(30))
    assert llm.core.scheduler.counters.preemptions_recompute > 0
    assert llm.core.watchdog.num_stalls == 0
