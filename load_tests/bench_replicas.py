"""Replicas on Ray Serve: session affinity vs Ray's default router vs one engine, on multi-turn chat.

32 conversations (``--conversations``) of ``--turns`` turns run at once over
``/v1/chat/completions`` (streamed, greedy, ``ignore_eos`` so each answer is
exactly ``--max-tokens``), each resending its history with its own
``x-session-id``; every conversation opens with the same system prompt of
about ``--system-tokens`` tokens and a distinct first question. Three
set-ups on one local Ray (``num_cpus`` = 2), one after the other:

- ``2x1 session``: 2 replicas x 1 thread, Ray Serve's consistent-hash router on x-session-id;
- ``2x1 default``: 2 replicas x 1 thread, Ray's default (power of two choices) router;
- ``1x2``: 1 replica x 2 threads, the single-engine baseline.

Per set-up: the cached share of the prompt (``cached_tokens / prompt_tokens``,
all turns and turns 2+), TTFT p50 / p99 by turn, and output tok/s (completion
tokens over the workload's wall time). Goals: affinity keeps >= 95% of the
baseline's cached share; the default router loses some; 2x1 output tok/s is
within 10% of 1x2.

    python -m load_tests.bench_replicas                      # SmolLM2-135M
    python -m load_tests.bench_replicas --model tiny --turns 3 --max-tokens 16   # smoke
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: make `load_tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from load_tests.common import (
    WORDS,
    ensure_tiny_model,
    free_port,
    goal,
    load_warning,
    make_parser,
    percentile,
    print_header,
    table,
    write_json,
)

SETUPS: dict[str, dict[str, Any]] = {
    "2x1 session": {"replicas": 2, "threads": 1, "router": "session"},
    "2x1 default": {"replicas": 2, "threads": 1, "router": "default"},
    "1x2": {"replicas": 1, "threads": 2, "router": "session"},
}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def one_turn(client: Any, session_id: str, messages: list[dict[str, str]], args: Any) -> dict[str, Any]:
    """One streamed chat completion: TTFT (first content delta), the answer text, the usage."""
    body = {
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"x-session-id": session_id}
    ) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        replica = resp.headers.get("x-streamkv-replica")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", ()):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {
        "replica": replica,
        "ttft_s": ttft,
        "text": "".join(text),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
    }


async def conversation(client: Any, index: int, system: str, args: Any) -> list[dict[str, Any]]:
    rng = random.Random(1000 + index)
    session_id = f"bench-{index:03d}-{rng.getrandbits(64):016x}"
    messages = [{"role": "system", "content": system}]
    rows = []
    for turn in range(args.turns):
        if turn > 0 and args.think_time > 0:
            await asyncio.sleep(rng.uniform(0.5, 1.5) * args.think_time)
        question = f"Question {index}.{turn}: " + words(rng, args.user_words)
        messages.append({"role": "user", "content": question})
        row = await one_turn(client, session_id, messages, args)
        messages.append({"role": "assistant", "content": row.pop("text")})
        rows.append({"conversation": index, "turn": turn + 1, **row})
    return rows


async def workload(url: str, args: Any) -> tuple[list[dict[str, Any]], float]:
    import httpx

    system = "You are a careful assistant. " + words(random.Random(7), args.system_tokens)
    limits = httpx.Limits(max_connections=2 * args.conversations)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(conversation(client, i, system, args) for i in range(args.conversations))),
            timeout=args.duration,
        )
        wall = time.perf_counter() - t0
    return [row for rows in results for row in rows], wall


def summarize(name: str, rows: list[dict[str, Any]], wall: float, turns: int) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] > 1]
    share = sum(r["cached_tokens"] for r in rows) / max(sum(r["prompt_tokens"] for r in rows), 1)
    share_later = sum(r["cached_tokens"] for r in later) / max(sum(r["prompt_tokens"] for r in later), 1)
    ttft = {}
    for t in range(1, turns + 1):
        xs = [1e3 * r["ttft_s"] for r in rows if r["turn"] == t and r["ttft_s"] is not None]
        ttft[t] = (percentile(xs, 50), percentile(xs, 99))
    out_tokens = sum(r["completion_tokens"] for r in rows)
    replica_of = {(r["conversation"], r["turn"]): r["replica"] for r in rows}
    moved = sum(1 for r in later if replica_of.get((r["conversation"], r["turn"] - 1)) != r["replica"])
    split = sorted(Counter(r["replica"] for r in rows).values(), reverse=True)
    return {
        "setup": name,
        "cached_share": share,
        "cached_share_turn2plus": share_later,
        "ttft_ms_by_turn": ttft,
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
        "requests_per_replica": split,
        "turns_moved": moved,
        "turns_2plus": len(later),
    }


def run_setup(name: str, model: str | None, args: Any, port: int) -> dict[str, Any]:
    from ray import serve

    from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
    from streamkv.server.ray_app import RayServeConfig, build_application, resolved

    spec = SETUPS[name]
    engine_config = resolved(
        EngineConfig(
            model=ModelConfig(model=model, device="cpu"),
            cache=CacheConfig(kv_cache_memory=args.kv_cache_memory),
            scheduler=SchedulerConfig(max_model_len=args.max_model_len),
        )
    )
    layout = RayServeConfig(replicas=spec["replicas"], num_cpus=float(spec["threads"]), router=spec["router"])
    # An app name of its own per set-up: the proxy keeps one router per deployment id, built with the
    # first deployment's router class, so a redeploy under the same name would keep the previous router.
    app_name = "bench-" + name.replace(" ", "-")
    t0 = time.perf_counter()
    serve.run(
        build_application(engine_config, ServerConfig(), layout, threads=spec["threads"]),
        name=app_name,
        route_prefix="/",
    )
    print(f"{name}: {spec['replicas']} replica(s) up in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        rows, wall = asyncio.run(workload(f"http://127.0.0.1:{port}", args))
    finally:
        serve.delete(app_name)
    result = summarize(name, rows, wall, args.turns)
    result["rows"] = rows
    return result


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--model", default=None, help="'tiny', a model folder / .gguf, or omit for SmolLM2-135M")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32, help="answer tokens per turn (ignore_eos)")
    parser.add_argument("--system-tokens", type=int, default=96, help="shared system prompt, about")
    parser.add_argument("--user-words", type=int, default=24, help="words per user turn")
    parser.add_argument(
        "--think-time", type=float, default=0.0,
        help="mean seconds a user reads before the next turn (uniform 0.5x..1.5x); with 0 a conversation "
        "resubmits the instant its replica frees a slot, which makes power-of-two-choices sticky by accident",
    )  # fmt: skip
    parser.add_argument("--kv-cache-memory", type=int, default=256 * 2**20, help="bytes of KV pool per replica")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated, of: " + ", ".join(SETUPS))
    parser.add_argument("--duration", type=float, default=900.0, help="seconds a set-up's workload may take")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--out", default="load_tests/out/bench_replicas.json")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.setups.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        parser.error(f"--setups: unknown {unknown}; choose from {list(SETUPS)}")

    import ray
    from ray import serve

    header = print_header(
        "Replicas on Ray Serve: affinity vs default router vs one engine", "load_tests.bench_replicas",
        conversations=args.conversations, turns=args.turns, max_tokens=args.max_tokens, think_time=args.think_time,
        model=args.model or "SmolLM2",
    )  # fmt: skip
    model = ensure_tiny_model() if args.model == "tiny" else args.model
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    results = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name in names:
            results.append(run_setup(name, model, args, port))
    finally:
        serve.shutdown()
        ray.shutdown()

    print()
    print(
        table(
            ["set-up", "cached share (all)", "cached share (turn 2+)", "turns 2+ that moved replica",
             "requests per replica", "output tok/s", "wall s"],
            [[r["setup"], r["cached_share"], r["cached_share_turn2plus"], f"{r['turns_moved']} / {r['turns_2plus']}",
              " + ".join(map(str, r["requests_per_replica"])), r["output_tok_s"], r["wall_s"]] for r in results],
            digits=3,
        )
    )  # fmt: skip
    print()
    turns = range(1, args.turns + 1)
    print(
        table(
            ["set-up", *[f"TTFT p50/p99 turn {t} (ms)" for t in turns]],
            [[r["setup"], *[f"{fmt_ms(r['ttft_ms_by_turn'][t])}" for t in turns]] for r in results],
        )
    )
    print()
    by = {r["setup"]: r for r in results}
    goals = []
    if "2x1 session" in by and "1x2" in by:
        a, b = by["2x1 session"], by["1x2"]
        ratio = a["cached_share_turn2plus"] / max(b["cached_share_turn2plus"], 1e-9)
        goals.append(goal("affinity keeps >= 95% of the single engine's cached share", ratio >= 0.95, f"{ratio:.3f}"))
        tput = a["output_tok_s"] / max(b["output_tok_s"], 1e-9)
        goals.append(goal("2x1 output tok/s within 10% of 1x2", abs(tput - 1) <= 0.10, f"{tput:.3f}x"))
    if "2x1 session" in by and "2x1 default" in by:
        a, d = by["2x1 session"], by["2x1 default"]
        drop = a["cached_share_turn2plus"] - d["cached_share_turn2plus"]
        goals.append(goal("the default router loses cached share", drop > 0, f"{drop:+.3f} (turns 2+)"))
    warning = load_warning(header["machine"])
    if warning:
        print(warning)
    write_json(args.out, {**header, "args": vars(args), "results": results, "goals": goals, "load_warning": warning})
    return 0


def fmt_ms(pair: tuple[float | None, float | None]) -> str:
    p50, p99 = pair
    return "-" if p50 is None or p99 is None else f"{p50:.0f} / {p99:.0f}"


if __name__ == "__main__":
    sys.exit(main())
