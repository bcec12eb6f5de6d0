"""Stats snapshots for ``/ws/stats``, ``/api/stats`` and the Prometheus collector.

Cheap by construction: the block pool keeps one state byte per block current
on every change, so a snapshot copies bytes and base64-encodes them instead
of walking the blocks.
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING

from streamkv.cache.block_pool import STATE_NAMES
from streamkv.sched.request import SeqStatus

if TYPE_CHECKING:
    from streamkv.engine_core import EngineCore


def build_snapshot(core: EngineCore, session_id: str | None = None, include_blocks: bool = True) -> dict:
    """One JSON-ready dict describing the pool and the engine.

    May be called from another thread than the engine's: every field is a
    copy taken under the GIL, so block states and counts agree with each
    other (both come from the same bytes copy), though not necessarily with
    the counters of the same instant.

    Keys: ``t`` (unix s), ``num_blocks``, ``block_size``, ``states`` (base64,
    one byte per block, see ``state_names``), ``counts``, ``kv_usage``
    (0..1), ``requests``, ``sessions``, ``counters``, ``finished``,
    ``tokens_per_s``, ``session_blocks`` (session id -> block ids: pins and
    the turn in flight). ``states`` and ``session_blocks`` only with
    ``include_blocks``.
    """
    kv = core.kv
    pool = kv.pool
    states = bytes(pool.states)
    counts = {name: states.count(i) for i, name in enumerate(STATE_NAMES)}
    used = core.num_blocks - counts["free"] - counts["cached"]
    sched = core.scheduler
    pc, sc = pool.counters, sched.counters
    snap: dict = {
        "t": time.time(),
        "num_blocks": core.num_blocks,
        "block_size": core.block_size,
        "state_names": list(STATE_NAMES),
        "counts": counts,
        "kv_usage": min(1.0, max(0.0, used / core.num_blocks)),
        "requests": {"running": len(sched.running), "waiting": len(sched.waiting), "swapped": len(sched.swapped)},
        "sessions": {"active": len(kv.sessions), "pinned_blocks": pool.num_pinned_blocks},
        "counters": {
            "prompt_tokens": sc.prompt_tokens,
            "generation_tokens": sc.generation_tokens,
            "computed_prompt_tokens": sc.computed_prompt_tokens,
            "prefix_cache_queries": pc.prefix_cache_queries,
            "prefix_cache_hits": pc.prefix_cache_hits,
            "preemptions": sc.preemptions_recompute + sc.preemptions_swap,
            "preemptions_recompute": sc.preemptions_recompute,
            "preemptions_swap": sc.preemptions_swap,
            "evictions": pc.evictions,
            "cow_copies": pc.cow_copies,
            "swapped_out_blocks": kv.num_swapped_out_blocks,
        },
        "finished": {r: core.finished_reasons.get(r, 0) for r in ("stop", "length", "cancelled")},
        "tokens_per_s": core.tokens_per_s(),
    }
    if include_blocks:
        snap["states"] = base64.b64encode(states).decode("ascii")
        sessions: dict[str, list[int]] = {}
        for sid, pin in list(kv.sessions.items()):
            if session_id is None or sid == session_id:
                sessions[sid] = [b.block_id for b in pin.blocks]
        for req in list(core.requests.values()):
            sid = req.session_id
            if sid is None or (session_id is not None and sid != session_id) or not req.seqs:
                continue
            seq = req.seqs[0]
            if seq.status is SeqStatus.RUNNING:
                sessions[sid] = kv.block_table(seq.seq_id)
        snap["session_blocks"] = sessions
    return snap
