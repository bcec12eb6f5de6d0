"""Decode stall: inter-token latency of running decodes while a long prompt prefills.

In-process ``EngineCore``, stepped here: 8 sequences decode (greedy,
``ignore_eos``), each sampled token timestamped in its sink; then a
2,000-token prompt arrives. ITLs of the 8 whose interval overlaps the long
prompt's prefill (arrival -> its first token) are compared for chunked
prefill (``max_num_batched_tokens`` 256: each step = 8 decodes + a chunk)
against an effectively unlimited budget (4096: the whole prompt in one step).

    python -m load_tests.bench_decode_stall                  # SmolLM2-135M
    python -m load_tests.bench_decode_stall --model tiny     # smoke
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: make `load_tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from load_tests.common import add_model_args, goal, load, make_parser, percentile, print_header, table, write_json


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def run_once(loaded: Any, budget: int, a: argparse.Namespace, seed: int) -> dict[str, Any]:
    from streamkv.llm import LLM
    from streamkv.sampling_params import SamplingParams

    llm = LLM(loaded=loaded, device="cpu", num_blocks=a.num_blocks, max_num_batched_tokens=budget, max_num_seqs=64)
    core = llm.core
    rng = random.Random(seed)
    vocab = loaded.hf_config.vocab_size
    stamps: dict[str, list[float]] = defaultdict(list)  # one time per token: the end of its step
    pending: dict[str, int] = defaultdict(int)

    def sink_for(rid: str) -> Any:
        def sink(out: Any) -> None:
            pending[rid] += sum(len(d.token_ids) for d in out.deltas)

        return sink

    decode = SamplingParams(temperature=0.0, max_tokens=a.decode_max_tokens, ignore_eos=True)
    rids = [f"d{i}" for i in range(a.decoders)]
    for rid in rids:
        core.add_request(rid, random_prompt(rng, a.decode_prompt, vocab), decode, sink_for(rid))
    deadline = time.monotonic() + a.time_limit
    steps = 0

    def step() -> None:
        nonlocal steps
        if steps >= a.max_steps or time.monotonic() > deadline:
            raise RuntimeError(f"bounded loop hit ({steps} steps, {a.time_limit:.0f} s limit)")
        core.step()
        steps += 1
        t = time.perf_counter()
        for rid, n in pending.items():
            stamps[rid].extend([t] * n)
        pending.clear()

    while min(len(stamps[r]) for r in rids) < a.warm_tokens:
        step()
    arrival = time.perf_counter()
    core.add_request("long", random_prompt(rng, a.long_prompt, vocab),
                     SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), sink_for("long"))  # fmt: skip
    steps_before = steps
    while not stamps["long"]:
        step()
    window_steps = steps - steps_before
    for _ in range(a.after_steps):
        step()
    first = stamps["long"][0]
    for rid in list(core.requests):
        core.abort(rid)
    core.check_invariants()
    during, before = [], []
    for rid in rids:
        ts = stamps[rid]
        for prev, cur in zip(ts, ts[1:], strict=False):
            if cur > arrival and prev < first:
                during.append(cur - prev)
            elif cur <= arrival:
                before.append(cur - prev)
    return {"during": during, "before": before, "ttft": first - arrival, "window_steps": window_steps}


def main(argv: list[str] | None = None) -> int:
    p = make_parser(__doc__)
    add_model_args(p)
    p.add_argument("--budgets", default="256,4096", help="max_num_batched_tokens values: chunked,unchunked")
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument("--decode-prompt", type=int, default=64, help="prompt tokens of each decoding sequence")
    p.add_argument("--decode-max-tokens", type=int, default=512)
    p.add_argument("--long-prompt", type=int, default=2000)
    p.add_argument("--warm-tokens", type=int, default=8, help="tokens each decoder has before the long prompt")
    p.add_argument("--after-steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="runs per budget (alternating), ITLs pooled")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--max-steps", type=int, default=2000, help="bound per run")
    p.add_argument("--time-limit", type=float, default=300.0, help="s bound per run")
    p.add_argument("--out", default=None, help="JSON results")
    a = p.parse_args(argv)
    budgets = [int(x) for x in a.budgets.split(",")]
    if len(budgets) != 2:
        p.error("--budgets takes two values: chunked,unchunked")
    loaded = load(a.model, a.threads)
    header = print_header("bench_decode_stall: decode ITL during a long prefill", "load_tests.bench_decode_stall")
    run_once(loaded, budgets[0], argparse.Namespace(**{**vars(a), "long_prompt": 64, "decoders": 2}), 99)  # warm-up
    runs: dict[int, list[dict[str, Any]]] = {b: [] for b in budgets}
    for r in range(a.repeats):
        for b in budgets:
            runs[b].append(run_once(loaded, b, a, seed=r))
    rows, stats = [], {}
    for b in budgets:
        during = [x * 1e3 for run in runs[b] for x in run["during"]]
        before = [x * 1e3 for run in runs[b] for x in run["before"]]
        ttft = [run["ttft"] * 1e3 for run in runs[b]]
        stats[b] = {"itl_p50": percentile(during, 50), "itl_p99": percentile(during, 99), "itl_max": max(during),
                    "baseline_p50": percentile(before, 50), "long_ttft_ms_p50": percentile(ttft, 50),
                    "samples": len(during), "window_steps": [run["window_steps"] for run in runs[b]]}  # fmt: skip
        s = stats[b]
        rows.append([b, s["baseline_p50"], s["itl_p50"], s["itl_p99"], s["itl_max"], s["long_ttft_ms_p50"],
                     s["samples"], s["window_steps"][0]])  # fmt: skip
    print(f"{a.decoders} decoding sequences ({a.decode_prompt}-token prompts), then a {a.long_prompt}-token prompt; "
          f"{a.repeats} run(s) per budget, ITLs pooled")  # fmt: skip
    print(table(["max_num_batched_tokens", "ITL p50 before (ms)", "ITL p50 during (ms)", "ITL p99 during (ms)",
                 "ITL max during (ms)", "long prompt TTFT (ms)", "ITL samples", "steps in window"], rows))  # fmt: skip
    chunked, unchunked = stats[budgets[0]], stats[budgets[1]]
    ratio = chunked["itl_p99"] / unchunked["itl_p99"]
    goals = [goal(f"p99 ITL during the prefill: budget {budgets[0]} <= 1/4 of budget {budgets[1]}", ratio <= 0.25,
                  f"{chunked['itl_p99']:.1f} ms vs {unchunked['itl_p99']:.1f} ms = {ratio:.2f}")]  # fmt: skip
    if a.out:
        write_json(a.out, {**header, "args": vars(a), "stats": stats, "goals": goals})
    return 0


if __name__ == "__main__":
    sys.exit(main())
