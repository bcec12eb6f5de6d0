"""One torch thread while other work competes for the cores; all of them again once the cores are free.

torch's OpenMP runtime (libgomp) has every thread of a parallel region spin
at its barrier until the others arrive; a decode step runs hundreds of
regions. When another busy process shares the cores, one of the engine's
threads is often off its core, and the others spin through their time
slices waiting for it. On the 2-core hosts here (docs/benchmarks.md, round
26), with one busy single-thread process in another session, the offline
engine at 2 threads fell from 90 to 0.8 output tok/s at B=1 and from 257 to
6.4 at B=8; at one thread, or with ``OMP_WAIT_POLICY=passive``, it kept
46-53 and ~148. OpenVINO GenAI (TBB) kept 17 of its ~28, vLLM CPU 7 of ~20.
Passive waiting costs 18-30% on a quiet host, so the engine keeps spinning
threads and instead drops to one thread while it sees contention:

- **Contention:** the engine thread's run-queue wait (``/proc/thread-self/
  schedstat``: nanoseconds runnable but not running) over its on-CPU plus
  wait time, per window of ``period_s``. At or above ``drop_share`` with at
  least ``min_busy_s`` of both, the governor sets one thread.
- **Free cores again:** at one thread, once ``hold_s`` has passed, a window
  of steps (the engine thread busy at least ``restore_busy`` of it) in which
  the machine's idle CPUs (``/proc/stat``: idle + iowait) reach
  ``restore_idle`` of the cores the other threads would use brings every
  thread back. A drop in the first window after a restore doubles
  ``hold_s`` (up to ``max_hold_s``); a restore that lasts resets it.
- **Idle gaps:** the engine calls :meth:`ThreadGovernor.pause` when it runs
  out of work and :meth:`ThreadGovernor.resume` before its next step, so a
  window counts only the time spent stepping, however short the requests.
  A gap of at least ``period_s`` also brings every thread back at resume
  (once ``hold_s`` has passed) when its idle CPUs reach ``restore_idle`` of
  *all* the cores: the engine used none of them, so that much idle time
  means nothing else is busy (beside one busy single-thread process a gap
  reads ~1 idle CPU of 2, short of 1.2). Without it a server that dropped
  during a burst stayed at one thread while idle, and began its next burst
  there for a window.
- **Failures:** a reading that fails turns the governor off and gives back
  every thread; it never raises into the engine thread.

The engine's results do not depend on its thread count: every kernel splits
work so that a row's sums run in one order (tests/test_small_linear.py,
tests/attention/test_cpu_paged.py), and tests/test_thread_governor.py checks
greedy output across a change of threads mid-generation.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

CLK_TCK = os.sysconf("SC_CLK_TCK")


def thread_schedstat() -> tuple[float, float]:
    """``(on-CPU seconds, run-queue wait seconds)`` of the calling thread (``/proc/thread-self/schedstat``).

    Raises:
        OSError: the kernel does not expose it.
    """
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, wait, _ = f.read().split()
    return int(on_cpu) / 1e9, int(wait) / 1e9


def idle_cpu_seconds() -> float:
    """Idle + iowait seconds since boot of the CPUs this process may run on (``/proc/stat``'s ``cpuN`` lines).

    Only the CPUs of ``os.sched_getaffinity``: under a cpuset the host's other CPUs would always look idle.

    Raises:
        OSError: ``/proc/stat`` cannot be read.
        ValueError: it has no line for any of those CPUs.
    """
    mine = {f"cpu{n}" for n in os.sched_getaffinity(0)}
    total, seen = 0, False
    with open("/proc/stat") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] in mine:
                total += int(fields[4]) + int(fields[5])
                seen = True
    if not seen:
        raise ValueError("/proc/stat has no line for this process's CPUs")
    return total / CLK_TCK


@dataclass
class _Window:
    t: float
    on_cpu: float
    wait: float
    idle: float


class ThreadGovernor:
    """Sets torch's thread count between ``threads`` and 1 from what the cores are doing; call :meth:`after_step`.

    Args:
        threads: the configured thread count (at 1 the governor does nothing).
        set_threads: applies a thread count (``torch.set_num_threads``).
        period_s: seconds of a measuring window.
        drop_share: run-queue wait over (on-CPU + wait) of the engine thread at which it drops to one thread.
        min_busy_s: on-CPU + wait seconds a window needs before its share counts.
        restore_idle: idle CPUs, as a fraction of ``threads - 1``, that bring the threads back.
        restore_busy: share of a window the engine thread must be busy (on a CPU or waiting for one) for the
            window to bring the threads back.
        hold_s: seconds at one thread before a restore is tried (doubles after a quick drop, up to ``max_hold_s``).
        clock, schedstat, idle_seconds: the readings (tests pass their own).
        on_change: called with the new thread count after each change (a gauge).
    """

    def __init__(
        self,
        threads: int,
        set_threads: Callable[[int], None],
        *,
        period_s: float = 0.5,
        drop_share: float = 0.2,
        min_busy_s: float = 0.2,
        restore_idle: float = 0.6,
        restore_busy: float = 0.5,
        hold_s: float = 2.0,
        max_hold_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        schedstat: Callable[[], tuple[float, float]] = thread_schedstat,
        idle_seconds: Callable[[], float] = idle_cpu_seconds,
        on_change: Callable[[int], None] | None = None,
    ) -> None:
        self.threads = self.current = threads
        self.set_threads = set_threads
        self.period_s, self.drop_share, self.min_busy_s = period_s, drop_share, min_busy_s
        self.restore_idle, self.restore_busy = restore_idle, restore_busy
        self.base_hold_s, self.max_hold_s = hold_s, max_hold_s
        self.hold_s = hold_s
        self.clock, self.schedstat, self.idle_seconds = clock, schedstat, idle_seconds
        self.on_change = on_change
        self.drops = 0
        self.enabled = threads > 1
        self._window: _Window | None = None
        self._changed_at = 0.0
        self._just_restored = False  # the next judged window is the first since a restore
        self._paused: _Window | None = None  # the readings when the engine went idle

    def _read(self) -> _Window:
        on_cpu, wait = self.schedstat()
        return _Window(self.clock(), on_cpu, wait, self.idle_seconds())

    def start(self) -> None:
        """Take the first window's baseline now, so the first step's time counts (without it the first
        :meth:`after_step` takes it: beside a busy process, a step of the collapse's 1.1 s at B=1 goes unjudged)."""
        if self.enabled and self._window is None:
            try:
                self._window = self._read()
            except Exception as e:  # noqa: BLE001 - see after_step
                self._off(e)

    def pause(self) -> None:
        """The engine has no work: the time until :meth:`resume` stays out of the current window (its clock,
        the idle CPUs and the thread's own on-CPU and wait time: an idle poll, or the caller's own work between
        two ``LLM.generate`` calls, is not a step)."""
        if self.enabled and self._window is not None and self._paused is None:
            try:
                self._paused = self._read()
            except Exception as e:  # noqa: BLE001 - see after_step
                self._off(e)

    def resume(self) -> None:
        """The engine steps again (call before the step): the window skips the gap since :meth:`pause`."""
        if self._paused is None or self._window is None:
            return
        paused, self._paused = self._paused, None
        try:
            now = self._read()
        except Exception as e:  # noqa: BLE001 - see after_step
            self._off(e)
            return
        w = self._window
        w.t += now.t - paused.t
        w.on_cpu += now.on_cpu - paused.on_cpu
        w.wait += now.wait - paused.wait
        w.idle += now.idle - paused.idle
        gap = now.t - paused.t
        if self.current < self.threads and gap >= self.period_s and now.t - self._changed_at >= self.hold_s:
            idle_cpus = (now.idle - paused.idle) / gap
            if idle_cpus >= self.restore_idle * self.threads:
                self._restore(now.t, f"{idle_cpus:.2f} CPUs idle while the engine was")

    def release(self) -> None:
        """The stepping ends: give back every thread, since ``torch.set_num_threads`` also sets the count that
        threads started later begin with (and the gauge follows)."""
        if self.current != self.threads:
            self._change(self.threads, self.clock(), "the engine stopped stepping")

    def after_step(self) -> None:
        """Take a window's reading when one is due, and change the thread count if it says so.

        Never raises: a reading that fails (no schedstat, a full file table) turns the governor off
        and gives back every thread.
        """
        if not self.enabled:
            return
        try:
            self._after_step()
        except Exception as e:  # noqa: BLE001 - the engine thread must not die of a /proc reading
            self._off(e)

    def _off(self, error: BaseException) -> None:
        logger.warning("thread governor off: %s", error)
        self.enabled = False
        if self.current != self.threads:
            self._change(self.threads, self.clock(), "the governor is off")

    def _after_step(self) -> None:
        if self._window is None:
            self._window = self._read()
            return
        now = self.clock()
        if now - self._window.t < self.period_s:
            return
        w, self._window = self._window, self._read()
        busy = (self._window.on_cpu - w.on_cpu) + (self._window.wait - w.wait)
        if self.current == self.threads:
            share = (self._window.wait - w.wait) / busy if busy > 0 else 0.0
            # a drop in the first window after a restore (however long its steps) doubles the hold
            quick, self._just_restored = self._just_restored, False
            logger.debug("thread governor: run-queue wait %.0f%% of %.2f s busy", 100 * share, busy)
            if busy >= self.min_busy_s and share >= self.drop_share:
                self.hold_s = min(2 * self.hold_s, self.max_hold_s) if quick else self.base_hold_s
                self._change(1, now, f"the engine thread waited for a core {share:.0%} of its busy time")
        elif now - self._changed_at >= self.hold_s and busy >= self.restore_busy * (now - w.t):
            # a window of steps: the engine computes on one core, so the other threads need the rest idle (an
            # unpaused idle stretch is no such window; a paused gap is judged by resume against all the cores)
            idle_cpus = (self._window.idle - w.idle) / (now - w.t)
            if idle_cpus >= self.restore_idle * (self.threads - 1):
                self._restore(now, f"{idle_cpus:.2f} CPUs idle")

    def _restore(self, now: float, why: str) -> None:
        self._just_restored = True  # a drop in the next judged window doubles the hold
        self._change(self.threads, now, why)

    def _change(self, threads: int, now: float, why: str) -> None:
        self.set_threads(threads)
        if threads < self.current:
            self.drops += 1
        logger.info("engine threads %d -> %d: %s", self.current, threads, why)
        self.current, self._changed_at = threads, now
        if self.on_change is not None:
            self.on_change(threads)
