"""Cost of a stats snapshot: ``EngineCore.publish_stats`` + ``streamkv.stats.snapshot_json`` + ``orjson.dumps``.

A real ``EngineCore`` (tiny model, so a 65,536-block pool fits in memory)
gets a realistic mix of block states through its own ``KVCacheManager``:
idle sessions pinning their history (``--pinned``), running sequences
(``--used``), forked pairs sharing blocks (``--shared``), freed prefixes
left in the prefix cache (``--cached``), the rest free. Each snapshot is
timed with block states (``/ws/stats``, ``/api/stats``) and without
(``/metrics``).

    python -m load_tests.bench_snapshot --num-blocks 4096,65536
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

if not __package__:  # run as a file: make `load_tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from load_tests.common import add_model_args, goal, load, make_parser, percentile, print_header, table, write_json


@dataclass(slots=True)
class FakeSeq:
    """A sequence as the cache manager sees it (``CacheSeq``)."""

    seq_id: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


def populate(core: Any, a: argparse.Namespace, rng: random.Random) -> dict[str, int]:
    """Drive the core's KVCacheManager into the requested mix (fractions of the pool)."""
    kv = core.kv
    bs, nb = kv.block_size, core.num_blocks
    ids = iter(range(10**9, 2 * 10**9))

    def seq_of(blocks: int) -> FakeSeq:
        n = blocks * bs - rng.randrange(bs)  # a partial last block, as in life
        s = FakeSeq(next(ids), [rng.randrange(100, 49_000) for _ in range(n)])
        assert kv.allocate_slots(s, n), "pool too small for the requested mix"
        s.num_computed_tokens = n
        kv.commit(s)
        return s

    def fill(fraction: float, each: int, act: Any) -> None:
        target = int(fraction * nb)
        while target > 0:
            k = min(each, target)
            act(seq_of(k), k)
            target -= k

    num_sessions = 0

    def pin(s: FakeSeq, k: int) -> None:
        nonlocal num_sessions
        kv.pin_session(f"session-{num_sessions}", s)
        num_sessions += 1

    fill(a.cached, a.blocks_per_seq, lambda s, k: kv.free(s.seq_id))
    fill(a.pinned, a.blocks_per_seq, pin)
    fill(a.used, a.blocks_per_seq, lambda s, k: None)
    def fork(s: FakeSeq, k: int) -> None:
        kv.fork(s, FakeSeq(next(ids), list(s.token_ids), s.num_computed_tokens))

    fill(a.shared, a.blocks_per_seq, fork)
    kv.check_invariants()
    return {**kv.pool.state_counts(), "sessions": num_sessions}


def measure(core: Any, include_blocks: bool, iters: int) -> dict[str, Any]:
    from streamkv.stats import snapshot_json

    build, dump, total = [], [], []
    size = 0
    for _ in range(iters):
        t0 = time.perf_counter()
        core.publish_stats()  # the engine thread's share, once per step
        snap = snapshot_json(core.stats, None, include_blocks)
        t1 = time.perf_counter()
        data = orjson.dumps(snap)
        t2 = time.perf_counter()
        build.append((t1 - t0) * 1e3)
        dump.append((t2 - t1) * 1e3)
        total.append((t2 - t0) * 1e3)
        size = len(data)
    return {"build_p50": percentile(build, 50), "dump_p50": percentile(dump, 50), "total_p50": percentile(total, 50),
            "total_p99": percentile(total, 99), "bytes": size}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = make_parser(__doc__)
    add_model_args(p, default_model="tiny")
    p.add_argument("--num-blocks", default="4096,65536")
    p.add_argument("--goals-ms", default="2,20", help="goal per pool size, ms (total p50)")
    p.add_argument("--pinned", type=float, default=0.30)
    p.add_argument("--used", type=float, default=0.25)
    p.add_argument("--shared", type=float, default=0.10)
    p.add_argument("--cached", type=float, default=0.15)
    p.add_argument("--blocks-per-seq", type=int, default=32, help="blocks per session / sequence")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results")
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.num_blocks.split(",")]
    limits = [float(x) for x in a.goals_ms.split(",")]
    if len(limits) != len(sizes):
        p.error("--goals-ms needs one value per --num-blocks size")
    loaded = load(a.model, a.threads)
    header = print_header("bench_snapshot: stats snapshot build + orjson", "load_tests.bench_snapshot")
    from streamkv.llm import LLM

    rows, results, goals = [], [], []
    for nb, limit in zip(sizes, limits, strict=True):
        core = LLM(loaded=loaded, device="cpu", num_blocks=nb, swap_space=0, max_pinned_fraction=1.0).core
        mix = populate(core, a, random.Random(a.seed))
        for include in (True, False):
            m = measure(core, include, a.iters)
            results.append({"num_blocks": nb, "include_blocks": include, "mix": mix, **m})
            rows.append([nb, "yes" if include else "no", mix["sessions"], m["build_p50"], m["dump_p50"],
                         m["total_p50"], m["total_p99"], m["bytes"] / 1024])  # fmt: skip
            if include:
                goals.append(goal(f"snapshot with block states at {nb} blocks < {limit:g} ms", m["total_p50"] < limit,
                                  f"p50 {m['total_p50']:.2f} ms, p99 {m['total_p99']:.2f} ms"))  # fmt: skip
        print(f"{nb} blocks: " + ", ".join(f"{k} {v}" for k, v in mix.items()))
        del core
    print(table(["num_blocks", "block states", "sessions", "build p50 ms", "orjson p50 ms", "total p50 ms",
                 "total p99 ms", "JSON KiB"], rows, digits=2))  # fmt: skip
    if a.out:
        write_json(a.out, {**header, "args": vars(a), "results": results, "goals": goals})
    return 0


if __name__ == "__main__":
    sys.exit(main())
