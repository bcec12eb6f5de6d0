"""A model-free driver for the scheduler: the real Scheduler over the real KVCacheManager.

The fake "model" computes every scheduled token; a sequence that samples
appends a token that depends only on (request, position), so a recomputed
sequence regenerates the same tokens (as greedy decoding would). A request
stops at ``max_tokens`` or at its own ``eos_at`` output length.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from streamkv.cache.kv_cache_manager import KVCacheManager
from streamkv.config import SchedulerConfig
from streamkv.sampling_params import SamplingParams
from streamkv.sched.output import SchedulerOutput
from streamkv.sched.request import Request, SeqStatus, Sequence
from streamkv.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Record = TypeVar("_Record", bound="DataclassInstance")


def _build(cls: type[_Record], **values: Any) -> _Record:
    """Construct a record from the fields it has (the engine-only ones may move elsewhere)."""
    fields = cls.__dataclass_fields__
    return cls(**{k: v for k, v in values.items() if k in fields})


@dataclass(slots=True)
class StepRecord:
    num_scheduled_tokens: int
    num_finished: int
    num_preempted: int


class SchedulerDriver:
    """Runs ``Scheduler.schedule`` / ``update`` with fake sampling; counts what happened.

    Args:
        num_blocks, block_size, enable_prefix_caching, max_pinned_fraction,
        num_host_blocks: the KV pool (as the engine builds it).
        **sched: SchedulerConfig fields (``max_num_batched_tokens``, ``preemption_mode`` ...).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_pinned_fraction: float = 0.5,
        num_host_blocks: int | None = None,
        **sched: Any,
    ) -> None:
        self.kv = KVCacheManager(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            max_pinned_blocks=int(max_pinned_fraction * num_blocks),
            num_host_blocks=num_blocks if num_host_blocks is None else num_host_blocks,
        )
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(SchedulerConfig(**sched), self.kv)
        self.requests: dict[str, Request] = {}
        self.finished: list[Request] = []
        self.eos_at: dict[str, int | None] = {}
        self.num_steps = 0
        self.max_preemptions_seen = 0
        self.check_waiting = True  # a waiting sequence holds no blocks
        self._seq_ids = itertools.count()
        self._order = itertools.count()

    # ---------------------------------------------------------------- requests

    def add(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        session_id: str | None = None,
        eos_at: int | None = None,
        n: int = 1,
    ) -> Request:
        """Queue a request whose prompt + max_tokens fits the pool; ``n`` samples fork after the prompt."""
        assert -(-(len(prompt) + max_tokens) // self.kv.block_size) <= self.num_blocks, "would never fit"
        req = _build(
            Request,
            request_id=request_id,
            prompt_token_ids=list(prompt),
            params=SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            max_tokens=max_tokens,
            arrival_time=float(self.num_steps),
            order=next(self._order),
            sink=lambda out: None,
            session_id=session_id,
        )
        seq = _build(
            Sequence,
            seq_id=next(self._seq_ids),
            request=req,
            index=0,
            token_ids=list(prompt),
            num_prompt_tokens=len(prompt),
            generator=None,
            detokenizer=None,
        )
        req.seqs.append(seq)
        self.requests[request_id] = req
        self.eos_at[request_id] = eos_at
        self.scheduler.add(seq)
        return req

    def _fork(self, parent: Sequence) -> None:
        """The engine's parallel sampling: at the first sample, n - 1 children share every block."""
        req = parent.request
        req.forked = True
        for i in range(1, req.params.n):
            child = _build(
                Sequence,
                seq_id=next(self._seq_ids),
                request=req,
                index=i,
                token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens,
                generator=None,
                detokenizer=None,
                num_computed_tokens=parent.num_computed_tokens,
            )
            req.seqs.append(child)
            self.kv.fork(parent, child)
            self.scheduler.add_running(child)
            self._sample(child)

    def cancel(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            self.scheduler.finish(seq, SeqStatus.FINISHED_ABORTED)
        self.finished.append(req)
        return True

    def release_session(self, session_id: str) -> bool:
        return self.kv.release_session(session_id)

    # -------------------------------------------------------------------- steps

    def step(self) -> StepRecord:
        """One engine step: schedule, 'compute', update, sample, finish."""
        out: SchedulerOutput = self.scheduler.schedule()
        self.kv.check_invariants()
        sampling = self.scheduler.update(out)
        num_before = len(self.finished)
        for s in sampling:
            seq = s.seq
            if seq.request.params.n > 1 and not seq.request.forked:
                self._fork(seq)
            self._sample(seq)
        done = len(self.finished) - num_before
        self.kv.check_invariants()
        for req in self.requests.values():
            for seq in req.seqs:
                self.max_preemptions_seen = max(self.max_preemptions_seen, seq.num_preemptions)
                if self.check_waiting and seq.status is SeqStatus.WAITING:
                    assert not self.kv.has_blocks(seq.seq_id), f"waiting seq {seq.seq_id} holds blocks"
        self.num_steps += 1
        return StepRecord(out.num_batched_tokens, done, out.num_preempted)

    def _sample(self, seq: Sequence) -> None:
        req = seq.request
        seq.token_ids.append(fake_token(req.order * 16 + seq.index, seq.num_tokens))
        eos = self.eos_at[req.request_id]
        if seq.num_output_tokens >= req.max_tokens or (eos is not None and seq.num_output_tokens >= eos):
            self.scheduler.finish(seq, SeqStatus.FINISHED_LENGTH)
            if req.finished:
                del self.requests[req.request_id]
                self.finished.append(req)

    def run(self, max_steps: int) -> int:
        """Step until no work is left; fail after ``max_steps`` steps. Returns the steps taken."""
        start = self.num_steps
        while self.scheduler.has_work():
            assert self.num_steps - start < max_steps, f"no finish within {max_steps} steps: {self.describe()}"
            self.step()
        return self.num_steps - start

    def describe(self) -> str:
        s = self.scheduler
        return (
            f"running {len(s.running)}, waiting {len(s.waiting)}, swapped {len(s.swapped)}, "
            f"free blocks {self.kv.pool.num_free_blocks}/{self.num_blocks}, pins {len(self.kv.sessions)}"
        )

    def assert_pool_whole(self) -> None:
        """Every block free or cached once all requests ended and all sessions closed."""
        self.kv.check_invariants()
        counts = self.kv.pool.state_counts()
        assert counts["used"] == counts["pinned"] == counts["shared"] == 0, counts
        assert self.kv.pool.num_free_blocks == self.num_blocks
        assert self.kv.host.num_used_blocks == 0


def fake_token(stream: int, position: int) -> int:
    """The token the fake model samples at ``position`` of one sample stream: fixed, so recompute agrees."""
    return 1000 + (stream * 7919 + position * 104729) % 30000


def tokens(n: int, seed: int) -> list[int]:
    """``n`` distinct-ish prompt tokens (below the fake model's sampled range)."""
    return [1 + (seed * 31 + i * 17) % 997 for i in range(n)]
