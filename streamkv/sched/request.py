"""Requests and their sequences, with the status lifecycle in one place.

A :class:`Request` is what a client asked for; it owns ``n`` sequences
(one per sample). The scheduler schedules sequences: after the prompt's
prefill, sequence 0 is forked into the other ``n - 1`` (sharing blocks).
One rule covers prefill chunks, prefix hits and resumption after
preemption: a sequence computes until ``num_computed_tokens`` reaches
``len(token_ids)``; it samples whenever it gets there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from streamkv.outputs import FinishReason
from streamkv.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The client-facing reason of a finished status; ``None`` while unfinished."""
        return FinishReason(self.value) if self in _FINISHED else None


_FINISHED = {SeqStatus.FINISHED_STOPPED, SeqStatus.FINISHED_LENGTH, SeqStatus.FINISHED_ABORTED}

_TRANSITIONS: dict[SeqStatus, set[SeqStatus]] = {
    SeqStatus.WAITING: {SeqStatus.RUNNING} | _FINISHED,
    SeqStatus.RUNNING: {SeqStatus.WAITING, SeqStatus.SWAPPED} | _FINISHED,
    SeqStatus.SWAPPED: {SeqStatus.RUNNING, SeqStatus.WAITING} | _FINISHED,
    SeqStatus.FINISHED_STOPPED: set(),
    SeqStatus.FINISHED_LENGTH: set(),
    SeqStatus.FINISHED_ABORTED: set(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample of a request: its tokens and how far its KV is computed."""

    seq_id: int
    request: Request
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def arrival(self) -> tuple[float, int, int]:
        """Priority key: earlier arrival first; ties by request then sample index."""
        return (self.request.arrival_time, self.request.order, self.index)

    def set_status(self, new: SeqStatus) -> None:
        """Move along the lifecycle; raise :class:`IllegalTransition` otherwise."""
        if new is self.status:
            return
        if new not in _TRANSITIONS[self.status]:
            raise IllegalTransition(f"seq {self.seq_id}: {self.status.value} -> {new.value}")
        self.status = new


@dataclass(slots=True, eq=False)
class Request:
    """A client's request as the scheduler sees it: prompt, sampling params, its sequences.

    Where outputs go (the sink), the detokenizers and the sampling generators
    live in :class:`streamkv.output_processor.OutputProcessor`, keyed by
    request id and sample index.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    order: int
    session_id: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    forked: bool = False

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.seqs)
