"""Soak: thousands of short conversations against a spawned server; memory must stay flat and every table empty.

Each conversation opens ``/ws/chat``, runs two turns and closes; a share of
them (``--abort-share``) close the socket in the middle of the second answer.
The workload is bounded in count (``--conversations``) and in time
(``--duration``). Reports the server process's RssAnon + VmSwap after the
warm-up and at the end (goal: growth under 50 MB), and then checks that the
server is back to empty: no request running, waiting or swapped, no session
(``streamkv_chat_sessions`` and the engine's pins), no open WebSocket, and
the pool whole (no used, pinned or shared block). The engine's own
per-request tables (output processor, detokenizers) are not visible from
outside the process: an empty ``requests`` count and a whole pool stand in
for them.

The server runs under ``load_tests.heap_probe`` (``--no-probe``: plain
``streamkv serve``), which at the warm-up and at ``--checkpoints`` evenly
spaced points after it reports where the memory is: live native heap
(glibc ``mallinfo2``) against its free slack, RSS after ``malloc_trim``,
live Python blocks, gc-tracked objects per type, asyncio tasks, threads and,
with ``--trace-frames``, a tracemalloc diff by source line. So growth in RSS
can be told apart: a leak of Python objects, native allocator slack, or
native memory held by a library.

oneDNN's caches. The CPU linears run on oneDNN-prepacked weights, and each
new input shape (a distinct row count, i.e. tokens in a step, times each
linear's ``(in, out)``) costs about 0.56 MB of native memory, half in
oneDNN's primitive cache and half in ideep's (torch's oneDNN wrapper), both
least-recently-used. The server bounds both (``serve
--onednn-cache-capacity``, default 256 entries, ~145 MB; the libraries' own
default, 1024, is ~0.56 GB). A soak meets new row counts for thousands of
conversations (a long tail of batch mixes), so while the caches are not
full their fill reads as a decaying leak (docs/benchmarks.md, "Soak"). The
soak spawns the server with its defaults and fails when the caches were not
yet full at the warm-up reading (the default warm-up of 300 conversations
ran 300 to 356 distinct shapes, measured): growth after the warm-up is then
everything but these caches. ``--onednn-cache-capacity N`` passes the flag
to the server (1024: the libraries' defaults); the soak clears the two env
vars from the server's environment, since a value there would override the
flag.

The goal is checked on the larger of two growths: RssAnon + VmSwap as read
on arrival, and the same after ``gc.collect()`` and ``malloc_trim(0)`` (the
probe trims at every reading, so the arrival figure after the first reading
is measured against a trimmed start and reads low; the trimmed one compares
like with like).

    python -m load_tests.bench_soak                 # 3,000 conversations, tiny model
    python -m load_tests.bench_soak --quick         # 40 conversations (the test suite's smoke run)
    python -m load_tests.bench_soak --trace-frames 1 --conversations 1000   # + the Python heap's diff by line
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from load_tests.common import SpawnedServer, ensure_tiny_model, http_get_json, make_parser, write_json
from load_tests.heap_probe import ONEDNN_CACHE_ENV, rss_anon_plus_swap

MB = 1 << 20
GOAL_GROWTH_MB = 50.0
WARMUP = 300


@dataclass(slots=True)
class Tally:
    completed: int = 0
    aborted: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def probe(pid: int, probe_dir: Path, n: int, timeout: float = 120.0) -> dict[str, Any]:
    """Ask the server's heap probe (``load_tests.heap_probe``) for its ``n``-th reading; wait for it (bounded)."""
    path = probe_dir / f"probe-{n}.json"
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the heap probe wrote no {path.name} within {timeout:.0f} s")
        time.sleep(0.1)
    return dict(orjson.loads(path.read_bytes()))


def _turn(ws: Any, frame: dict[str, Any], abort: bool, timeout: float) -> str:
    """Send a chat frame; read to its ``done`` (or, with ``abort``, to its first delta). Returns the last type."""
    ws.send(orjson.dumps(frame).decode())
    deadline = time.monotonic() + timeout
    while True:
        msg = orjson.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
        if msg["type"] == "error":
            raise RuntimeError(f"{msg['code']}: {msg['message']}")
        if msg["type"] == "done" or (abort and msg["type"] == "delta"):
            return str(msg["type"])


def conversation(url: str, rng: random.Random, abort: bool, max_tokens: int, timeout: float) -> None:
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with connect(url, open_timeout=timeout, close_timeout=timeout) as ws:
        _turn(ws, {"type": "chat", "content": f"Question {rng.randrange(10**6)}?", "params": params}, False, timeout)
        long_params = {**params, "max_tokens": max_tokens * 8} if abort else params
        _turn(ws, {"type": "chat", "content": "And then?", "params": long_params}, abort, timeout)


def worker(url: str, seed: int, jobs: list[bool], tally: Tally, deadline: float, args: Any) -> None:
    rng = random.Random(seed)
    for abort in jobs:
        if time.monotonic() > deadline:
            return
        try:
            conversation(url, rng, abort, args.max_tokens, args.request_timeout)
            with tally.lock:
                tally.aborted += abort
                tally.completed += not abort
        except Exception as e:  # recorded, the soak goes on
            with tally.lock:
                tally.errors.append(f"{type(e).__name__}: {e}")


def run_phase(url: str, jobs: list[bool], args: Any, tally: Tally, deadline: float, seed: int) -> None:
    threads = [
        threading.Thread(target=worker, args=(url, seed + i, jobs[i :: args.concurrency], tally, deadline, args))
        for i in range(args.concurrency)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def leftovers(http_url: str, timeout: float) -> dict[str, float]:
    """What is still held once the load is over (waits, bounded, for it to drain); all zero when clean."""
    deadline = time.monotonic() + timeout
    while True:
        snap = http_get_json(http_url + "/api/stats")
        metrics = {}
        with urllib.request.urlopen(http_url + "/metrics", timeout=5) as resp:  # noqa: S310 - our loopback server
            for fam in text_string_to_metric_families(resp.read().decode()):
                for s in fam.samples:
                    if fam.name == "streamkv_chat_sessions":
                        metrics[f"chat_sessions_{s.labels['state']}"] = s.value
                    elif fam.name == "streamkv_open_connections" and s.labels.get("kind") == "websocket":
                        metrics["open_websockets"] = s.value
        held = {
            **{f"requests_{k}": float(v) for k, v in snap["requests"].items()},
            "pinned_sessions": float(snap["sessions"]["active"]),
            **{f"blocks_{k}": float(snap["counts"][k]) for k in ("used", "pinned", "shared")},
            **metrics,
        }
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def served_cache_capacity(http_url: str) -> dict[str, float]:
    """The server's ``streamkv_onednn_cache_capacity`` gauge, by cache (``onednn``, ``ideep``)."""
    with urllib.request.urlopen(http_url + "/metrics", timeout=5) as resp:  # noqa: S310 - our loopback server
        return {
            s.labels["cache"]: s.value
            for fam in text_string_to_metric_families(resp.read().decode())
            if fam.name == "streamkv_onednn_cache_capacity"
            for s in fam.samples
        }


def summarize(reading: dict[str, Any]) -> dict[str, Any]:
    """A probe reading without its per-type counts, rounded for the report."""
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in reading.items() if k != "gc_types"}


def probe_growth(first: dict[str, Any], last: dict[str, Any], top: int = 12) -> dict[str, Any]:
    """What grew between two probe readings: each figure, the gc-tracked types that grew most, and, when
    both readings carry a tracemalloc snapshot, the source lines whose live Python allocations grew most."""
    keys = ("rss_mb", "rss_trimmed_mb", "malloc_in_use_mb", "malloc_free_mb", "traced_mb", "py_blocks",
            "asyncio_tasks", "threads", "onednn_linear_shapes")  # fmt: skip
    growth: dict[str, Any] = {
        k: round(last[k] - first[k], 1) for k in keys if first.get(k) is not None and last.get(k) is not None
    }
    before, after = first["gc_types"], last["gc_types"]
    deltas = {t: after.get(t, 0) - before.get(t, 0) for t in set(before) | set(after)}
    growth["gc_types_grown"] = dict(sorted(((t, d) for t, d in deltas.items() if d > 0), key=lambda x: -x[1])[:top])
    if "snap" in first and "snap" in last:
        old, new = tracemalloc.Snapshot.load(first["snap"]), tracemalloc.Snapshot.load(last["snap"])
        growth["heap_top_lines"] = [
            f"{d.size_diff / 1024:+.1f} KiB ({d.count_diff:+d} blocks) {d.traceback}"  # "file:line"
            for d in new.compare_to(old, "lineno")[:top]
        ]
    return growth


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--conversations", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=WARMUP, help="conversations before the first memory reading")
    parser.add_argument("--abort-share", type=float, default=0.2, help="share closed mid-answer")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds; the soak stops here regardless")
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--model", default=None, help="default: the tiny random Llama")
    parser.add_argument("--checkpoints", type=int, default=3, help="memory readings after the warm-up, evenly spaced")
    parser.add_argument("--no-probe", action="store_true", help="spawn plain `streamkv serve` (RSS readings only)")
    parser.add_argument("--trace-frames", type=int, default=None,
                        help="run the server under tracemalloc with this many frames and diff its snapshots "
                        "(slows the server; its own bookkeeping inflates RSS)")  # fmt: skip
    parser.add_argument("--onednn-cache-capacity", type=int, default=None,
                        help="the server's --onednn-cache-capacity (default: the server's default)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="40 conversations, 10 of warm-up (a smoke run)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.warmup, args.concurrency, args.checkpoints = 40, 10, 4, 1
    rng = random.Random(0)
    jobs = [rng.random() < args.abort_share for _ in range(args.conversations)]
    model = args.model or ensure_tiny_model()
    serve_args = ["--model", model, "--device", "cpu", "--num-blocks", "512", "--session-ttl", "60"]
    if args.onednn_cache_capacity is not None:
        serve_args += ["--onednn-cache-capacity", str(args.onednn_cache_capacity)]
    tally = Tally()
    t0 = time.monotonic()
    deadline = t0 + args.duration
    for name in ONEDNN_CACHE_ENV:  # the spawned server inherits this environment; a value there beats the flag
        os.environ.pop(name, None)
    server = SpawnedServer(serve_args)
    probe_dir = Path(tempfile.mkdtemp(prefix="streamkv-soak-probe-"))
    if not args.no_probe:
        trace = ["--trace-frames", str(args.trace_frames)] if args.trace_frames else []
        server.args = [sys.executable, "-m", "load_tests.heap_probe", "--probe-dir", str(probe_dir), *trace,
                       *server.args[3:]]  # fmt: skip   # [python, -m, streamkv, serve, ...]
    readings: list[dict[str, Any]] = []
    rss: list[tuple[int, float]] = []
    held: dict[str, float] = {}
    served_capacity: dict[str, float] = {}
    with server:
        assert server.proc is not None
        pid = server.proc.pid
        bounds = [args.warmup + (len(jobs) - args.warmup) * k // max(args.checkpoints, 1)
                  for k in range(max(args.checkpoints, 1) + 1)]  # fmt: skip
        start = 0
        for k, end in enumerate(bounds):
            run_phase(server.ws_url, jobs[start:end], args, tally, deadline, seed=1 + 1000 * k)
            start = end
            if k == len(bounds) - 1:
                held = leftovers(server.http_url, timeout=30.0)
                served_capacity = served_cache_capacity(server.http_url)
            rss.append((tally.completed + tally.aborted, rss_anon_plus_swap(pid) / MB))
            if not args.no_probe:
                reading = probe(pid, probe_dir, k)
                snap = probe_dir / f"heap-{k}.snap"
                readings.append({**reading, **({"snap": str(snap)} if snap.exists() else {})})
    growth_mb = rss[-1][1] - rss[0][1]
    done = tally.completed + tally.aborted
    result = {
        "conversations": done,
        "planned": args.conversations,
        "warmup": args.warmup,
        "aborted": tally.aborted,
        "errors": len(tally.errors),
        "first_errors": tally.errors[:5],
        "wall_s": round(time.monotonic() - t0, 1),
        "rss_anon_swap_after_warmup_mb": round(rss[0][1], 1),
        "rss_anon_swap_final_mb": round(rss[-1][1], 1),
        "growth_mb": round(growth_mb, 1),
        "rss_by_conversations": [[n, round(mb, 1)] for n, mb in rss],
        "left_over": held,
        "onednn_cache_capacity_gauge": served_capacity,
    }
    cache_full = None
    checked_mb = growth_mb
    if readings:
        first, last = readings[0], readings[-1]
        # No oneDNN matmul at all (fp32 on an AVX2 build: the small-batch kernel takes every batch): no cache to fill.
        if last["onednn_linear_shapes"] > 0:
            cache_full = first["onednn_linear_shapes"] >= first["onednn_cache_capacity"]
        checked_mb = max(growth_mb, last["rss_trimmed_mb"] - first["rss_trimmed_mb"])
        result["growth_trimmed_mb"] = round(last["rss_trimmed_mb"] - first["rss_trimmed_mb"], 1)
        if "malloc_in_use_mb" in first:
            result["native_in_use_growth_mb"] = round(last["malloc_in_use_mb"] - first["malloc_in_use_mb"], 1)
        result["python_blocks_growth"] = last["py_blocks"] - first["py_blocks"]
        result["onednn_cache_full_at_warmup"] = cache_full
        result["probes"] = [summarize(r) for r in readings]
        result["probe_growth"] = probe_growth(readings[0], readings[-1])
        if len(readings) > 2:
            result["probe_growth_last_segment"] = probe_growth(readings[-2], readings[-1])
    result["goal_growth_mb"] = round(checked_mb, 1)  # what the goal is checked on (module doc)
    shutil.rmtree(probe_dir, ignore_errors=True)
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    if args.out:
        write_json(args.out, result)
    failed = []
    if tally.errors:
        failed.append(f"{len(tally.errors)} conversation(s) failed: {tally.errors[0]}")
    if done < args.conversations:
        failed.append(f"only {done} of {args.conversations} conversations ran within --duration")
    if any(held.values()):
        failed.append(f"not back to empty: { {k: v for k, v in held.items() if v} }")
    if not args.quick and checked_mb >= GOAL_GROWTH_MB:
        failed.append(f"memory grew {checked_mb:.1f} MB after warm-up (goal < {GOAL_GROWTH_MB:.0f} MB)")
    if not args.quick and cache_full is False:
        failed.append(
            f"the oneDNN/ideep caches were not full at the warm-up reading ({readings[0]['onednn_linear_shapes']} "
            f"shapes < {readings[0]['onednn_cache_capacity']}): the growth includes its fill; raise --warmup or "
            "pass a lower --onednn-cache-capacity"
        )
    if readings and max(served_capacity.values(), default=None) != readings[0]["onednn_cache_capacity"]:
        failed.append(f"the capacity gauge {served_capacity} disagrees with the server's environment "
                      f"({readings[0]['onednn_cache_capacity']})")  # fmt: skip
    for line in failed:
        print(f"SOAK FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
