"""WebSocket load generator: N concurrent multi-turn chat sessions against ``/ws/chat``.

Each session opens one socket, sends ``--turns`` chat frames (the first with a
shared system prompt), waits ``--think-time`` between turns, and records per
request: TTFT (send -> first delta with tokens), inter-token latencies (gap
between deltas / tokens in the delta), output tokens, errors, empty answers.
``/api/stats`` is polled every ``--stats-interval`` s for KV usage, prefix
hits and preemptions. Every wait is bounded by ``--request-timeout`` and the
global ``--duration``.

    python -m load_tests.loadgen --spawn --serve-args "--model /path/tiny" --sessions 4 --turns 3
    python -m load_tests.loadgen --url ws://127.0.0.1:8000/ws/chat --sessions 16 --turns 8 --out run.json

Exit status 1 (and a FAILED line on stderr) when a request errored or came
back empty, or when the duration bound cut turns short (unless
``--allow-empty`` / ``--allow-incomplete``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
from websockets.asyncio.client import connect

if not __package__:  # run as a file: make `load_tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from load_tests.common import (
    WORDS,
    SpawnedServer,
    ensure_tiny_model,
    fmt,
    http_get_json,
    make_parser,
    percentile,
    print_header,
    table,
    write_json,
)
from load_tests.plots import plot_loadgen


@dataclass(slots=True)
class RequestRecord:
    session: int
    turn: int
    t_send: float  # s since the run started
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # one entry per token after the first delta
    output_tokens: int = 0
    text_chars: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    server_ttft_ms: float | None = None
    finish_reason: str | None = None
    duration_s: float | None = None
    error: str | None = None
    incomplete: bool = False  # cut by --duration


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def span(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(":")
    a = float(lo)
    return a, float(hi) if hi else a


def draw(rng: random.Random, spec: str, dist: str) -> int:
    """An integer in LO..HI: uniform, or log-normal around the geometric mean (sigma 0.5) clipped to the range."""
    lo, hi = span(spec)
    if dist == "lognormal" and lo > 0:
        return int(min(hi, max(lo, round((lo * hi) ** 0.5 * rng.lognormvariate(0.0, 0.5)))))
    return rng.randint(int(lo), int(hi))


class Run:
    def __init__(self, args: argparse.Namespace, url: str) -> None:
        self.args = args
        self.url = url
        parts = urlsplit(url)
        self.http = f"{'https' if parts.scheme == 'wss' else 'http'}://{parts.netloc}"
        self.system = words(random.Random(args.seed), args.system_tokens) if args.system_tokens > 0 else None
        self.records: list[RequestRecord] = []
        self.samples: list[dict[str, Any]] = []
        self.stats_errors = 0
        self.t0 = 0.0
        self.deadline = 0.0
        self.bar: Any = None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def session(self, idx: int) -> None:
        a = self.args
        rng = random.Random(a.seed * 100_003 + idx)
        await asyncio.sleep(a.ramp * idx / max(1, a.sessions - 1) if a.sessions > 1 else 0.0)
        try:
            async with asyncio.timeout(max(0.1, self.deadline - self.now())):
                ws = await connect(self.url, open_timeout=min(10.0, a.request_timeout), close_timeout=2,
                                   max_size=1 << 22)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - any connect failure is one error
            self.records.append(RequestRecord(idx, 0, self.now(), error=f"connect: {type(e).__name__}: {e}"))
            return
        try:
            for turn in range(a.turns):
                if turn:
                    await asyncio.sleep(min(rng.uniform(*span(a.think_time)), max(0.0, self.deadline - self.now())))
                if self.now() >= self.deadline:
                    return
                content = words(rng, draw(rng, a.user_words, a.user_words_dist))
                frame: dict[str, Any] = {"type": "chat", "content": content}
                if turn == 0 and self.system is not None:
                    frame["system"] = self.system
                params: dict[str, Any] = {"max_tokens": draw(rng, a.max_tokens, "uniform"),
                                          "temperature": a.temperature, "seed": rng.randrange(2**31)}  # fmt: skip
                if a.ignore_eos:
                    params["ignore_eos"] = True
                frame["params"] = params
                rec = await self.request(ws, idx, turn, frame)
                self.records.append(rec)
                if self.bar is not None:
                    self.bar.update(1)
                if rec.incomplete or (rec.error or "").startswith(("timeout", "closed")):
                    return  # the socket is mid-turn or gone: stop this session
        finally:
            await ws.close()

    async def request(self, ws: Any, idx: int, turn: int, frame: dict[str, Any]) -> RequestRecord:
        rec = RequestRecord(idx, turn, self.now())
        sent = time.perf_counter()
        last: float | None = None
        limit = min(self.args.request_timeout, self.deadline - self.now())
        cut_by_duration = limit < self.args.request_timeout
        try:
            async with asyncio.timeout(max(0.0, limit)):
                await ws.send(orjson.dumps(frame).decode())
                while True:
                    msg = orjson.loads(await ws.recv())
                    t = time.perf_counter()
                    kind = msg.get("type")
                    if kind == "delta":
                        n = len(msg.get("token_ids") or ())
                        rec.text_chars += len(msg.get("text") or "")
                        if n:
                            if last is None:
                                rec.ttft_s = t - sent
                            else:
                                rec.itl_s.extend([(t - last) / n] * n)
                            last = t
                            rec.output_tokens += n
                    elif kind == "done":
                        usage, timings = msg.get("usage") or {}, msg.get("timings") or {}
                        rec.prompt_tokens, rec.cached_tokens = usage.get("prompt_tokens"), usage.get("cached_tokens")
                        rec.server_ttft_ms = timings.get("ttft_ms")
                        rec.finish_reason = msg.get("finish_reason")
                        if usage.get("completion_tokens") != rec.output_tokens:
                            rec.error = (f"usage says {usage.get('completion_tokens')} tokens, "
                                         f"deltas carried {rec.output_tokens}")  # fmt: skip
                        break
                    elif kind == "error":
                        rec.error = f"{msg.get('code')}: {msg.get('message')}"
                        break
        except TimeoutError:
            if cut_by_duration:
                rec.incomplete = True
            else:
                rec.error = f"timeout after {self.args.request_timeout:.0f} s"
        except Exception as e:  # noqa: BLE001 - a dropped socket is recorded, not raised
            rec.error = f"closed: {type(e).__name__}: {e}"
        rec.duration_s = time.perf_counter() - sent
        return rec

    async def stats(self) -> dict[str, Any] | None:
        try:
            return await asyncio.to_thread(http_get_json, self.http + "/api/stats", 5.0)
        except Exception:  # noqa: BLE001 - stats are best effort; counted
            self.stats_errors += 1
            return None

    async def poll(self) -> None:
        while True:
            t, snap = self.now(), await self.stats()
            if snap is not None:
                c, r = snap["counters"], snap["requests"]
                self.samples.append({
                    "t": round(t, 3), "kv_usage": snap["kv_usage"], "running": r["running"], "waiting": r["waiting"],
                    "swapped": r.get("swapped", 0), "pinned_blocks": snap["sessions"]["pinned_blocks"],
                    "preemptions": c["preemptions"], "tokens_per_s": snap.get("tokens_per_s"),
                    "prefix_cache_queries": c["prefix_cache_queries"], "prefix_cache_hits": c["prefix_cache_hits"],
                })  # fmt: skip
            await asyncio.sleep(self.args.stats_interval)

    async def main(self) -> dict[str, Any]:
        a = self.args
        before = await self.stats()
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=a.sessions * a.turns, unit="turn", file=sys.stderr, disable=a.no_progress)
        except ImportError:
            self.bar = None
        self.t0 = time.perf_counter()
        self.deadline = a.duration
        poller = asyncio.create_task(self.poll())
        try:
            await asyncio.gather(*(self.session(i) for i in range(a.sessions)))
        finally:
            wall = self.now()
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
            if self.bar is not None:
                self.bar.close()
        after = await self.stats()
        return summarize(self, wall, before, after)


def summarize(run: Run, wall: float, before: dict | None, after: dict | None) -> dict[str, Any]:
    recs = run.records
    ok = [r for r in recs if r.error is None and not r.incomplete]
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    itl = [x * 1e3 for r in ok for x in r.itl_s]
    out_tokens = sum(r.output_tokens for r in recs)
    s: dict[str, Any] = {
        "wall_s": wall, "requests_planned": run.args.sessions * run.args.turns, "requests_ok": len(ok),
        "errors": sum(r.error is not None for r in recs), "incomplete": sum(r.incomplete for r in recs),
        "empty": sum(1 for r in ok if r.output_tokens == 0 or r.text_chars == 0),
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p90": percentile(ttft, 90), "ttft_ms_p99": percentile(ttft, 99),
        "itl_ms_p50": percentile(itl, 50), "itl_ms_p99": percentile(itl, 99),
        "server_ttft_ms_p50": percentile([r.server_ttft_ms for r in ok if r.server_ttft_ms is not None], 50),
        "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall if wall > 0 else None,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "max_kv_usage": max((x["kv_usage"] for x in run.samples), default=None),
        "stats_samples": len(run.samples), "stats_errors": run.stats_errors,
    }  # fmt: skip
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    s["cached_prompt_share"] = sum(r.cached_tokens or 0 for r in ok) / prompt if prompt else None
    s["turns_not_started"] = s["requests_planned"] - len(recs)
    if before is not None and after is not None:
        cb, ca = before["counters"], after["counters"]
        q = ca["prefix_cache_queries"] - cb["prefix_cache_queries"]
        s["prefix_hit_rate"] = (ca["prefix_cache_hits"] - cb["prefix_cache_hits"]) / q if q else None
        s["preemptions"] = ca["preemptions"] - cb["preemptions"]
        s["computed_prompt_tokens"] = ca["computed_prompt_tokens"] - cb["computed_prompt_tokens"]
    return s


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = make_parser(__doc__)
    p.add_argument("--url", default="ws://127.0.0.1:8000/ws/chat")
    p.add_argument("--spawn", action="store_true", help="start `streamkv serve` on 127.0.0.1:<free port> for the run")
    p.add_argument("--serve-args", default="", help="arguments for the spawned server (one string)")
    p.add_argument("--model", default=None,
                   help="with --spawn: shorthand for --serve-args '--model X' ('tiny': the tiny random Llama)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="s to wait for the spawned server's /healthz")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=256,
                   help="approx. length of the shared system prompt (0: none)")
    p.add_argument("--user-words", default="8:48", help="user message length in words, uniform LO:HI")
    p.add_argument("--user-words-dist", choices=("uniform", "lognormal"), default="uniform")
    p.add_argument("--max-tokens", default="16:64", help="answer max_tokens, uniform LO:HI")
    p.add_argument("--think-time", default="0.5:2", help="s between a done and the next turn, uniform LO:HI")
    p.add_argument("--ramp", type=float, default=0.0, help="spread session starts over this many s")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--ignore-eos", action="store_true", help="answers run to max_tokens exactly")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=120.0, help="global bound in s")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--stats-interval", type=float, default=0.5)
    p.add_argument("--allow-empty", action="store_true", help="empty answers do not fail the run")
    p.add_argument("--allow-incomplete", action="store_true", help="hitting --duration does not fail the run")
    p.add_argument("--out", default=None, help="JSON results (a PNG is written next to it)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.sessions < 1 or args.turns < 1 or args.duration <= 0 or args.request_timeout <= 0:
        p.error("--sessions, --turns, --duration and --request-timeout must be positive")
    for name in ("user_words", "max_tokens", "think_time"):
        try:
            span(getattr(args, name))
        except ValueError:
            p.error(f"--{name.replace('_', '-')}: expected LO:HI or a number")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    header = print_header("loadgen: concurrent multi-turn WebSocket chat sessions", "load_tests.loadgen")
    model = ensure_tiny_model() if args.model == "tiny" else args.model
    serve_args = shlex.split(args.serve_args) + (["--model", model] if model else [])
    if args.spawn:
        with SpawnedServer(serve_args, start_timeout_s=args.start_timeout) as srv:
            run = Run(args, srv.ws_url)
            summary = asyncio.run(run.main())
    else:
        run = Run(args, args.url)
        summary = asyncio.run(run.main())
    rows = [(k, summary.get(k)) for k in (
        "requests_planned", "requests_ok", "errors", "empty", "incomplete", "turns_not_started", "ttft_ms_p50",
        "ttft_ms_p90", "ttft_ms_p99", "server_ttft_ms_p50", "itl_ms_p50", "itl_ms_p99", "output_tokens",
        "output_tokens_per_s", "requests_per_s", "prefix_hit_rate", "cached_prompt_share", "computed_prompt_tokens",
        "preemptions", "max_kv_usage", "wall_s")]  # fmt: skip
    print(table(["metric", "value"], rows, digits=3))
    failures = []
    if summary["errors"]:
        errs = sorted({r.error for r in run.records if r.error})
        failures.append(f"{summary['errors']} request(s) errored: {'; '.join(e[:160] for e in errs[:5])}")
    if summary["empty"] and not args.allow_empty:
        failures.append(f"{summary['empty']} empty response(s)")
    if (summary["incomplete"] or summary["turns_not_started"]) and not args.allow_incomplete:
        failures.append(f"--duration {args.duration:g} s hit: {summary['incomplete']} cut, "
                        f"{summary['turns_not_started']} never started")  # fmt: skip
    if args.out:
        out = Path(args.out)
        write_json(out, {**header, "args": vars(args), "summary": summary,
                         "requests": [asdict(r) for r in run.records], "stats": run.samples})  # fmt: skip
        try:
            title = f"{args.sessions} sessions x {args.turns} turns"
            plot_loadgen(run.records, run.samples, out.with_suffix(".png"), title)
        except Exception as e:  # noqa: BLE001 - a plot never hides the verdict
            failures.append(f"plot failed: {type(e).__name__}: {e}")
    for f in failures:
        print(f"LOADGEN FAILED: {f}", file=sys.stderr)
    print("result: " + ("FAILED" if failures else "OK") + f" ({fmt(summary['requests_ok'])} requests ok)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
