"""Pool pressure: a burst of 64 requests into a KV pool sized for ~16, recompute vs swap.

In-process ``EngineCore`` stepped here. Every request has the same shape
(``--prompt`` tokens, exactly ``--output`` new tokens, greedy); the pool has
``--fits`` requests' worth of blocks, so the scheduler must preempt. Rows:
an ample pool (no pressure: the reference), ``recompute`` and ``swap``
(host tier as large as the pool). Reported: wall time, output tokens/s,
requests completed, preemptions, max running, whether the outputs equal the
reference's (greedy), and whether the pool is whole afterwards (invariants,
every block free or cached, the host tier empty).

    python -m load_tests.bench_pool_pressure                 # SmolLM2-135M
    python -m load_tests.bench_pool_pressure --model tiny    # smoke
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: make `load_tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from load_tests.common import add_model_args, goal, load, make_parser, print_header, table, write_json


def run(loaded: Any, a: argparse.Namespace, mode: str, num_blocks: int, prompts: list[list[int]]) -> dict[str, Any]:
    from streamkv.llm import LLM
    from streamkv.runner import kv_bytes_per_block
    from streamkv.sampling_params import SamplingParams

    swap_bytes = num_blocks * kv_bytes_per_block(loaded, a.block_size)
    llm = LLM(loaded=loaded, device="cpu", num_blocks=num_blocks, block_size=a.block_size,
              preemption_mode="swap" if mode == "swap" else "recompute", swap_space=swap_bytes,
              max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens)  # fmt: skip
    core = llm.core
    params = SamplingParams(temperature=0.0, max_tokens=a.output, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}

    def sink_for(rid: str) -> Any:
        def sink(out: Any) -> None:
            for d in out.deltas:
                tokens[rid].extend(d.token_ids)
                reasons[rid] = d.finish_reason or reasons[rid]

        return sink

    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        tokens[rid], reasons[rid] = [], None
        core.add_request(rid, prompt, params, sink_for(rid))
    steps, max_running, max_usage = 0, 0, 0.0
    deadline = time.monotonic() + a.time_limit
    while core.has_work() and steps < a.max_steps and time.monotonic() < deadline:
        core.step()
        steps += 1
        max_running = max(max_running, len(core.scheduler.running))
        max_usage = max(max_usage, core.kv.pool.usage())
    wall = time.perf_counter() - t0
    bounded_out = core.has_work()
    for rid in list(core.requests):
        core.abort(rid)
    core.check_invariants()
    counts = core.kv.pool.state_counts()
    whole = (counts["used"] == counts["pinned"] == counts["shared"] == 0
             and core.kv.pool.num_free_blocks == num_blocks and core.kv.host.num_used_blocks == 0)  # fmt: skip
    c = core.scheduler.counters
    done = sum(1 for rid in tokens if reasons[rid] == "length" and len(tokens[rid]) == a.output)
    return {"mode": mode, "num_blocks": num_blocks, "wall_s": wall, "steps": steps,
            "output_tokens": sum(len(t) for t in tokens.values()), "completed": done,
            "preemptions_recompute": c.preemptions_recompute, "preemptions_swap": c.preemptions_swap,
            "computed_prompt_tokens": c.computed_prompt_tokens, "swapped_out_blocks": core.kv.num_swapped_out_blocks,
            "max_running": max_running, "max_kv_usage": max_usage, "pool_whole": whole, "cut_by_bound": bounded_out,
            "tokens": tokens}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = make_parser(__doc__)
    add_model_args(p)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--fits", type=int, default=16, help="the pool holds this many whole requests")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=64, help="new tokens per request (exact)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--modes", default="ample,recompute,swap")
    p.add_argument("--max-steps", type=int, default=20_000, help="bound per run")
    p.add_argument("--time-limit", type=float, default=600.0, help="s bound per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results")
    a = p.parse_args(argv)
    loaded = load(a.model, a.threads)
    header = print_header("bench_pool_pressure: 64-request burst into a pool for 16", "load_tests.bench_pool_pressure")
    rng = random.Random(a.seed)
    vocab = loaded.hf_config.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(a.prompt)] for _ in range(a.requests)]
    per_request = -(-(a.prompt + a.output) // a.block_size)
    tight = a.fits * per_request
    print(f"{a.requests} requests x ({a.prompt} prompt + {a.output} output) tokens = {per_request} blocks each; "
          f"tight pool {tight} blocks (fits {a.fits}), ample pool {a.requests * per_request}")  # fmt: skip
    results = []
    for mode in a.modes.split(","):
        nb = a.requests * per_request if mode == "ample" else tight
        results.append(run(loaded, a, mode, nb, prompts))
    ref = next((r for r in results if r["mode"] == "ample"), None)
    rows = []
    for r in results:
        same = None if ref is None else r["tokens"] == ref["tokens"]
        r["same_as_ample"] = same
        rows.append([r["mode"], r["num_blocks"], r["wall_s"], r["output_tokens"] / r["wall_s"],
                     f"{r['completed']}/{a.requests}", r["preemptions_recompute"], r["preemptions_swap"],
                     r["swapped_out_blocks"], r["computed_prompt_tokens"], r["max_running"], r["steps"], same,
                     r["pool_whole"]])  # fmt: skip
    print(table(["mode", "blocks", "wall s", "output tok/s", "completed", "preempt recompute", "preempt swap",
                 "blocks swapped out", "prompt tokens computed", "max running", "steps", "same tokens as ample",
                 "pool whole after"], rows))  # fmt: skip
    goals = [goal(f"{r['mode']}: all completed, pool whole" + ("" if r["same_as_ample"] is None else ", same tokens"),
                  r["completed"] == a.requests and r["pool_whole"] and r["same_as_ample"] is not False,
                  f"{r['completed']}/{a.requests} completed, pool whole {r['pool_whole']}")
             for r in results]  # fmt: skip
    if a.out:
        write_json(a.out, {**header, "args": vars(a), "goals": goals,
                           "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in results]})  # fmt: skip
    return 0 if all(g["passed"] for g in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
