"""The seam between scheduler and runner: what to compute this step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamkv.cache.host_tier import SpillJob
    from streamkv.sched.request import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step.

    Attributes:
        seq: the sequence (the runner reads only the fields below).
        token_ids: the tokens computed this step.
        start_pos: position of ``token_ids[0]`` (= computed tokens before the step).
        block_table: physical block ids covering ``start_pos + len(token_ids)`` tokens.
        samples: the chunk reaches the sequence's last token, so its logits are sampled.
    """

    seq: Sequence
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    samples: bool


@dataclass(slots=True)
class SchedulerOutput:
    """A step's batch plus the block copies the runner applies before the forward.

    Copies are applied in this order: ``spills`` are read (host blocks of
    sessions going to disk, whose ids this step may reuse), ``swap_out``
    (device -> host, before the freed device blocks are rewritten; in list
    order, a later copy into a host block wins), ``swap_in`` (host ->
    device), ``copies`` (device -> device, copy-on-write).
    """

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    spills: list[SpillJob] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swap_out and not self.swap_in and not self.spills
