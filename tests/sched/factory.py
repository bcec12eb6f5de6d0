"""The one place the scheduler tests build requests, sequences and steps.

Everything that knows the fields of :class:`Request` and :class:`Sequence`,
or where admission checks live, is here, so a change of those records is a
one-place fix for ``tests/sched/``. No model: steps are scheduled and
updated, and each sequence that samples gets :data:`SAMPLED` appended, the
way the engine core appends a sampled token.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from streamkv.cache.kv_cache_manager import KVCacheManager
from streamkv.config import PreemptionMode, SchedulerConfig
from streamkv.engine_core import EngineCore
from streamkv.sampling_params import SamplingParams
from streamkv.sched.output import SchedulerOutput
from streamkv.sched.request import Request, Sequence
from streamkv.sched.scheduler import Scheduler

BLOCK_SIZE = 4
SAMPLED = 7  # the token every sampling sequence gets

_ids = itertools.count()


def make_scheduler(
    num_blocks: int = 64,
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    preemption_mode: str = "recompute",
    num_host_blocks: int = 0,
    max_pinned_blocks: int | None = None,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    """A scheduler over a real :class:`KVCacheManager` of ``num_blocks`` blocks of :data:`BLOCK_SIZE` tokens."""
    kv = KVCacheManager(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=enable_prefix_caching,
        max_pinned_blocks=max_pinned_blocks,
        num_host_blocks=num_host_blocks,
    )
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        preemption_mode=PreemptionMode(preemption_mode),
    )
    return Scheduler(config, kv)


def make_seq(prompt: int | list[int], *, session_id: str | None = None, max_tokens: int = 1000) -> Sequence:
    """A new request's sequence 0; later calls arrive later.

    ``prompt`` is the prompt itself or its length (then its tokens are
    unique to this request, so no prefix hits).
    """
    order = next(_ids)
    token_ids = list(range(order * 10_000, order * 10_000 + prompt)) if isinstance(prompt, int) else list(prompt)
    request = Request(
        request_id=f"req-{order}",
        prompt_token_ids=list(token_ids),
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        max_tokens=max_tokens,
        arrival_time=float(order),
        order=order,
        session_id=session_id,
    )
    seq = Sequence(
        seq_id=order,
        request=request,
        index=0,
        token_ids=token_ids,
        num_prompt_tokens=len(token_ids),
    )
    request.seqs.append(seq)
    return seq


def step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule, "run" and update one step; sampling sequences get :data:`SAMPLED`. Checks the pool after."""
    out = scheduler.schedule()
    for s in scheduler.update(out):
        s.seq.token_ids.append(SAMPLED)
    scheduler.kv.check_invariants()
    return out


def num_new_tokens(out: SchedulerOutput) -> dict[int, int]:
    """Seq id -> tokens scheduled this step, in the step's order."""
    return {s.seq.seq_id: len(s.token_ids) for s in out.scheduled}


def validate(
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int = 100,
    max_model_len: int = 64,
    num_blocks: int = 8,
) -> int:
    """The engine's admission check on a model of ``vocab_size`` tokens; returns the effective ``max_tokens``.

    Today the check is :meth:`EngineCore.validate`, which reads only these
    four numbers of the engine, so it runs here without a model.
    """
    engine = SimpleNamespace(
        loaded=SimpleNamespace(hf_config=SimpleNamespace(vocab_size=vocab_size)),
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
    )
    return EngineCore.validate(engine, prompt_token_ids, params)  # type: ignore[arg-type]
