"""A progress watchdog for the engine thread: steps that run while nothing progresses.

The scheduler guarantees progress (see :mod:`streamkv.sched.scheduler`);
this is the alarm for when that guarantee is broken. The engine calls
:meth:`Watchdog.observe` once per step with the tokens it computed and the
requests finished so far. After ``max_idle_steps`` consecutive steps with
work queued, no token computed and no request finished, the watchdog
declares a stall: it logs the scheduler state once, counts the stall, and
``stalled`` stays true (``/healthz`` reports ``degraded``) until a step
progresses again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_MAX_IDLE_STEPS = 64


@dataclass(slots=True)
class Watchdog:
    """Counts steps without progress.

    Attributes:
        max_idle_steps: consecutive idle steps that make a stall (at least 1).
        num_idle_steps: idle steps in the current run of them.
        num_stalls: stalls declared so far (monotonic; a metric).
        stalled: a stall is in progress.
    """

    max_idle_steps: int = DEFAULT_MAX_IDLE_STEPS
    num_idle_steps: int = 0
    num_stalls: int = 0
    stalled: bool = False
    _num_finished: int = 0

    def __post_init__(self) -> None:
        if self.max_idle_steps < 1:
            raise ValueError("max_idle_steps must be at least 1")

    def observe(self, num_computed_tokens: int, num_finished_total: int, describe: Callable[[], str]) -> bool:
        """Record one step; returns ``True`` on the step that declares a stall.

        Args:
            num_computed_tokens: tokens the step computed.
            num_finished_total: requests finished so far, any reason (monotonic);
                a request finished between steps (a cancel) counts as progress.
            describe: the scheduler state for the log line (called once per stall).
        """
        finished = num_finished_total != self._num_finished
        self._num_finished = num_finished_total
        if num_computed_tokens > 0 or finished:
            if self.stalled:
                logger.warning("engine progressing again after %d idle steps", self.num_idle_steps)
            self.num_idle_steps = 0
            self.stalled = False
            return False
        self.num_idle_steps += 1
        if self.stalled or self.num_idle_steps < self.max_idle_steps:
            return False
        self.stalled = True
        self.num_stalls += 1
        logger.error("engine stalled: %d steps without a computed token or a finished request; %s",
                     self.num_idle_steps, describe())  # fmt: skip
        return True
