"""The collector switch around model loading, the start-up heap freeze of a serving process, and the pause timer."""

from __future__ import annotations

import collections
import gc
import subprocess
import sys
import textwrap

import pytest
from prometheus_client.parser import text_string_to_metric_families

from streamkv.gc_control import CollectionTimer, gc_paused
from streamkv.metrics import EngineMetrics


def test_gc_paused_turns_collection_off_and_restores_the_state_it_found() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block found it off, so it leaves it off
    assert gc.isenabled()

    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a failed load")
    assert gc.isenabled()

    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_freeze_startup_heap_leaves_later_collections_only_new_objects() -> None:
    # In a child process: a freeze is for the life of the process, and this one runs the rest of the suite.
    code = textwrap.dedent(
        """
        import gc
        from streamkv.gc_control import freeze_startup_heap

        heap = [[i] for i in range(50_000)]  # long-lived container objects, as a loaded model's are
        seconds = freeze_startup_heap()
        assert seconds > 0 and gc.get_freeze_count() >= 50_000, gc.get_freeze_count()
        assert len(gc.get_objects()) < 1_000, len(gc.get_objects())  # what a full collection now walks
        cycle = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # garbage made after the freeze is still collected
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_collection_timer_times_each_collection_by_generation_until_closed() -> None:
    timer = CollectionTimer(max_pending=3)
    try:
        gc.collect(2)
        gc.collect(0)
        seen: list[tuple[int, float]] = []
        timer.drain(lambda generation, seconds: seen.append((generation, seconds)))
        assert [g for g, _ in seen] == [2, 0] and all(0 <= s < 5 for _, s in seen)
        timer.drain(lambda generation, seconds: seen.append((generation, seconds)))
        assert len(seen) == 2  # drained once

        for _ in range(5):
            gc.collect(1)
        assert timer.dropped == 2  # the bound keeps the newest 3
        timer.drain(lambda generation, seconds: seen.append((generation, seconds)))
        assert [g for g, _ in seen[2:]] == [1, 1, 1]
    finally:
        timer.close()
    assert timer._callback not in gc.callbacks
    gc.collect()
    timer.drain(lambda generation, seconds: pytest.fail("timed after close"))


def test_metrics_render_drains_the_timer_into_the_pause_histogram() -> None:
    m = EngineMetrics()
    timer = CollectionTimer()
    m.attach_gc_timer(timer)
    try:
        gc.collect(2)
        gc.collect(2)
        got = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(m.render()[0].decode())
            for s in family.samples
        }
    finally:
        timer.close()
    assert got[("streamkv_gc_pause_seconds_count", (("generation", "2"),))] == 2
    assert got[("streamkv_gc_pause_seconds_count", (("generation", "0"),))] == 0  # pre-created: zeros before the first
    assert got[("streamkv_gc_pause_seconds_sum", (("generation", "2"),))] > 0


def test_pauses_past_the_timers_bound_are_counted_once_in_the_dropped_counter() -> None:
    m = EngineMetrics()
    timer = CollectionTimer(max_pending=2)
    m.attach_gc_timer(timer)

    def dropped() -> float:
        families = text_string_to_metric_families(m.render()[0].decode())
        return next(s.value for f in families for s in f.samples if s.name == "streamkv_gc_pauses_dropped_total")

    try:
        with gc_paused():  # no automatic collection (the render allocates) between the counted ones
            assert dropped() == 0
            for _ in range(5):
                gc.collect(0)
            assert dropped() == 3  # 5 pauses, 2 kept: 3 never timed
            assert dropped() == 3  # a second scrape adds nothing
            gc.collect(0)
            assert dropped() == 3  # the drain emptied the deque: one more pause fits
            m.attach_gc_timer(timer)  # attached again: its drops are not counted twice
            assert dropped() == 3
    finally:
        timer.close()


def test_a_drain_racing_another_returns_when_the_other_took_the_last_pause() -> None:
    """Two scrapes drain at once; the deque can empty between one drain's look and its pop."""

    class EmptiedUnderfoot(collections.deque[tuple[int, float]]):
        def __bool__(self) -> bool:  # looks non-empty, as it did just before the other drain's pop
            return True

    timer = CollectionTimer()
    timer.close()
    timer._pending = EmptiedUnderfoot([(0, 0.001)])
    seen: list[tuple[int, float]] = []
    timer.drain(lambda generation, seconds: seen.append((generation, seconds)))  # must not raise IndexError
    assert seen == [(0, 0.001)]
