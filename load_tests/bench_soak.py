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

    python -m load_tests.bench_soak                 # 3,000 conversations, tiny model
    python -m load_tests.bench_soak --quick         # 40 conversations (the test suite's smoke run)
"""

from __future__ import annotations

import random
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from load_tests.common import SpawnedServer, ensure_tiny_model, http_get_json, make_parser, write_json

MB = 1 << 20
GOAL_GROWTH_MB = 50.0


@dataclass(slots=True)
class Tally:
    completed: int = 0
    aborted: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def rss_anon_plus_swap(pid: int) -> int:
    """Bytes of RssAnon + VmSwap of a process (Linux ``/proc/<pid>/status``)."""
    total = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "VmSwap"):
            total += int(value.split()[0]) * 1024
    return total


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


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--conversations", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300, help="conversations before the first memory reading")
    parser.add_argument("--abort-share", type=float, default=0.2, help="share closed mid-answer")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds; the soak stops here regardless")
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--model", default=None, help="default: the tiny random Llama")
    parser.add_argument("--quick", action="store_true", help="40 conversations, 10 of warm-up (a smoke run)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.warmup, args.concurrency = 40, 10, 4
    rng = random.Random(0)
    jobs = [rng.random() < args.abort_share for _ in range(args.conversations)]
    model = args.model or ensure_tiny_model()
    serve_args = ["--model", model, "--device", "cpu", "--num-blocks", "512", "--session-ttl", "60"]
    tally = Tally()
    t0 = time.monotonic()
    deadline = t0 + args.duration
    with SpawnedServer(serve_args) as server:
        assert server.proc is not None
        pid = server.proc.pid
        run_phase(server.ws_url, jobs[: args.warmup], args, tally, deadline, seed=1)
        after_warmup = rss_anon_plus_swap(pid)
        run_phase(server.ws_url, jobs[args.warmup :], args, tally, deadline, seed=1000)
        held = leftovers(server.http_url, timeout=30.0)
        final = rss_anon_plus_swap(pid)
    growth_mb = (final - after_warmup) / MB
    done = tally.completed + tally.aborted
    result = {
        "conversations": done,
        "planned": args.conversations,
        "aborted": tally.aborted,
        "errors": len(tally.errors),
        "first_errors": tally.errors[:5],
        "wall_s": round(time.monotonic() - t0, 1),
        "rss_anon_swap_after_warmup_mb": round(after_warmup / MB, 1),
        "rss_anon_swap_final_mb": round(final / MB, 1),
        "growth_mb": round(growth_mb, 1),
        "left_over": held,
    }
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
    if not args.quick and growth_mb >= GOAL_GROWTH_MB:
        failed.append(f"memory grew {growth_mb:.1f} MB after warm-up (goal < {GOAL_GROWTH_MB:.0f} MB)")
    for line in failed:
        print(f"SOAK FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
