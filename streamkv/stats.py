"""The engine's stats snapshot: one immutable record per step, and its JSON form.

The engine thread builds an :class:`EngineStats` from the stats records of
their owners (the scheduler, the KV cache manager, the output processor)
after every step and every command, and swaps it in with one attribute
assignment. Other threads (``/api/stats``, ``/ws/stats``, the Prometheus
collector) only ever read a published record, never live engine state.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from streamkv.cache.block import STATE_NAMES
from streamkv.cache.cache_stats import KVCacheStats
from streamkv.output_processor import OutputStats
from streamkv.sched.scheduler import SchedulerStats


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One step's view of the engine.

    Attributes:
        scheduler: queue lengths and scheduling counters.
        kv: block states, pins and cache counters.
        outputs: token counters, finished samples, recent throughput points.
        turn_blocks: session id -> block table of the session's turn in flight
            (sample 0 while it is running).
        kv_cache_dtype: the resolved KV storage (``float32`` ... ``int8``).
        kv_bytes_per_token: KV bytes one token costs across all layers, scales included.
    """

    scheduler: SchedulerStats
    kv: KVCacheStats
    outputs: OutputStats
    turn_blocks: dict[str, tuple[int, ...]]
    kv_cache_dtype: str | None = None
    kv_bytes_per_token: int | None = None


def snapshot_json(stats: EngineStats, session_id: str | None = None, include_blocks: bool = True) -> dict[str, Any]:
    """The JSON-ready dict of ``/api/stats`` and ``/ws/stats`` (also read by ``/metrics``).

    Keys: ``t`` (unix s, when this dict is built), ``num_blocks``,
    ``block_size``, ``state_names``, ``counts``, ``kv_usage`` (0..1),
    ``requests``, ``sessions``, ``counters``, ``offload`` (the fields of
    :class:`~streamkv.cache.cache_stats.OffloadStats`), ``finished``, ``tokens_per_s``
    (over the last 5 s, as of now), ``kv_cache`` (``dtype``,
    ``bytes_per_token``) when the engine set them; with ``include_blocks`` also ``states``
    (base64, one byte per block, see ``state_names``) and ``session_blocks``
    (``{session_id: block ids}``, its pin or its turn in flight; empty
    without a ``session_id``). Session ids are capabilities (holding one is
    enough to resume the conversation), so a snapshot never names a session
    other than the caller's own: other sessions' blocks show only as states.
    """
    kv, sc, out = stats.kv, stats.scheduler, stats.outputs
    counts = {name: kv.states.count(i) for i, name in enumerate(STATE_NAMES)}
    used = kv.num_blocks - counts["free"] - counts["cached"]
    snap: dict[str, Any] = {
        "t": time.time(),
        "num_blocks": kv.num_blocks,
        "block_size": kv.block_size,
        "state_names": list(STATE_NAMES),
        "counts": counts,
        "kv_usage": min(1.0, max(0.0, used / kv.num_blocks)),
        "requests": {"running": sc.num_running, "waiting": sc.num_waiting, "swapped": sc.num_swapped},
        "sessions": {"active": kv.num_sessions, "pinned_blocks": kv.num_pinned_blocks},
        "counters": {
            "prompt_tokens": out.prompt_tokens,
            "generation_tokens": out.generation_tokens,
            "computed_prompt_tokens": sc.computed_prompt_tokens,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "preemptions": sc.preemptions_recompute + sc.preemptions_swap,
            "preemptions_recompute": sc.preemptions_recompute,
            "preemptions_swap": sc.preemptions_swap,
            "evictions": kv.evictions,
            "cow_copies": kv.cow_copies,
            "swapped_out_blocks": kv.num_swapped_out_blocks,
        },
        "offload": dataclasses.asdict(kv.offload),  # sessions off the pool (host, disk tiers)
        "finished": {str(reason): n for reason, n in out.finished.items()},
        "tokens_per_s": out.tokens_per_s(),
    }
    if stats.kv_cache_dtype is not None:
        snap["kv_cache"] = {"dtype": stats.kv_cache_dtype, "bytes_per_token": stats.kv_bytes_per_token}
    if include_blocks:
        snap["states"] = base64.b64encode(kv.states).decode("ascii")
        sessions: dict[str, list[int]] = {}
        if session_id is not None:
            for pin in kv.pins:
                if pin.session_id == session_id:
                    sessions[session_id] = [b.block_id for b in pin.blocks]
            turn = stats.turn_blocks.get(session_id)  # a turn in flight supersedes its pin
            if turn is not None:
                sessions[session_id] = list(turn)
        snap["session_blocks"] = sessions
    return snap
