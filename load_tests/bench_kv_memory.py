"""KV memory efficiency of the paged pool vs contiguous pre-allocation (no model).

A fixed-seed trace of requests whose prompt and output lengths are drawn
from wide log-normal distributions runs through the real ``KVCacheManager``
in simulated steps: a request is admitted while its whole prompt fits
(``allocate_slots`` for the prefill), then gets one slot per step until its
output is done, and is freed. A decode that finds the pool dry preempts the
newest running request (recompute: freed, requeued at the front), as the
scheduler does. The contiguous system runs the same trace with
``budget_tokens // max_model_len`` requests at once, each reserving
``max_model_len`` slots.

Slot use = time-averaged tokens held / slots reserved (sum over steps of
held / sum of reserved; also the mean of per-step ratios).

    python -m load_tests.bench_kv_memory --requests 2000 --num-blocks 4096
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as a file: make `load_tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from load_tests.common import goal, make_parser, print_header, table, write_json
from streamkv.cache.kv_cache_manager import KVCacheManager


@dataclass(slots=True)
class SimSeq:
    """What the cache manager reads of a sequence (``CacheSeq``)."""

    seq_id: int
    prompt_len: int
    output_len: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output: int = 0


def make_trace(n: int, seed: int, max_model_len: int, prompt_median: float, output_median: float, sigma: float
               ) -> list[tuple[int, int]]:  # fmt: skip
    """``n`` (prompt_len, output_len) pairs, log-normal, clipped so that prompt + output <= max_model_len."""
    rng = random.Random(seed)
    trace = []
    for _ in range(n):
        p = int(min(max_model_len - 1, max(1, rng.lognormvariate(0, sigma) * prompt_median)))
        o = int(min(max_model_len - p, max(1, rng.lognormvariate(0, sigma) * output_median)))
        trace.append((p, o))
    return trace


@dataclass(slots=True)
class Result:
    steps: int = 0
    held: int = 0  # sum over steps of tokens whose KV is stored
    reserved: int = 0  # sum over steps of slots reserved
    ratio_sum: float = 0.0  # sum over steps of held / reserved
    running_sum: int = 0
    max_running: int = 0
    preemptions: int = 0
    seconds: float = 0.0

    def row(self, name: str) -> list[object]:
        return [name, 100 * self.held / max(1, self.reserved), 100 * self.ratio_sum / max(1, self.steps),
                self.running_sum / max(1, self.steps), self.max_running, self.steps, self.preemptions]  # fmt: skip


def run_paged(trace: list[tuple[int, int]], num_blocks: int, block_size: int, watermark: float, max_steps: int
              ) -> Result:  # fmt: skip
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    waiting = [SimSeq(i, p, o) for i, (p, o) in enumerate(trace)]
    waiting.reverse()  # pop() takes the oldest
    running: list[SimSeq] = []
    res = Result()
    reserve = int(watermark * num_blocks)
    t0 = time.perf_counter()
    while (waiting or running) and res.steps < max_steps:
        # decodes first (oldest first): one slot each, preempting the newest when dry
        for seq in list(running):
            if seq not in running:
                continue
            while not kv.allocate_slots(seq, 1):
                victim = running.pop()
                kv.free(victim.seq_id)
                victim.num_computed_tokens = victim.num_output = 0
                victim.token_ids = []
                waiting.append(victim)
                res.preemptions += 1
                if victim is seq:
                    break
            else:
                seq.num_computed_tokens += 1
                seq.num_output += 1
        # admit while the whole prefill fits above the watermark
        while waiting:
            seq = waiting[-1]
            need = -(-seq.prompt_len // block_size)
            if kv.pool.num_free_blocks - need < reserve and running:
                break
            seq.token_ids = [0] * seq.prompt_len
            if not kv.allocate_slots(seq, seq.prompt_len):
                break
            waiting.pop()
            seq.num_computed_tokens = seq.prompt_len
            seq.num_output = 1  # the prefill step samples the first output token
            running.append(seq)
        res.steps += 1
        held = sum(s.num_computed_tokens for s in running)
        reserved = sum(len(kv.seq_blocks[s.seq_id]) for s in running) * block_size
        res.held += held
        res.reserved += reserved
        res.ratio_sum += held / reserved if reserved else 1.0
        res.running_sum += len(running)
        res.max_running = max(res.max_running, len(running))
        for seq in [s for s in running if s.num_output >= s.output_len]:
            running.remove(seq)
            kv.free(seq.seq_id)
    kv.check_invariants()
    assert kv.pool.num_free_blocks == num_blocks, "blocks leaked"
    res.seconds = time.perf_counter() - t0
    return res


def run_contiguous(trace: list[tuple[int, int]], slots: int, max_model_len: int, max_steps: int) -> Result:
    capacity = slots // max_model_len
    waiting = list(reversed(trace))
    running: list[list[int]] = []  # [tokens held, output done, output target]
    res = Result()
    while (waiting or running) and res.steps < max_steps:
        for r in running:
            r[0] += 1
            r[1] += 1
        while waiting and len(running) < capacity:
            p, o = waiting.pop()
            running.append([p, 1, o])
        res.steps += 1
        held = sum(r[0] for r in running)
        res.held += held
        res.reserved += len(running) * max_model_len
        res.ratio_sum += held / (len(running) * max_model_len) if running else 1.0
        res.running_sum += len(running)
        res.max_running = max(res.max_running, len(running))
        running = [r for r in running if r[1] < r[2]]
    return res


def main(argv: list[str] | None = None) -> int:
    p = make_parser(__doc__)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--num-blocks", type=int, default=4096, help="pool size (the memory budget)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--prompt-median", type=float, default=384, help="median prompt tokens (log-normal)")
    p.add_argument("--output-median", type=float, default=192, help="median output tokens (log-normal)")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of both lengths")
    p.add_argument("--watermark", type=float, default=0.01, help="pool fraction kept free at admission")
    p.add_argument("--max-steps", type=int, default=2_000_000, help="bound on simulated steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results")
    a = p.parse_args(argv)
    header = print_header(
        "bench_kv_memory: paged KV slot use and concurrency vs contiguous", "load_tests.bench_kv_memory"
    )
    trace = make_trace(a.requests, a.seed, a.max_model_len, a.prompt_median, a.output_median, a.sigma)
    ps, os_ = sorted(t[0] for t in trace), sorted(t[1] for t in trace)
    q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    print(f"trace: {a.requests} requests, seed {a.seed}; prompt p10/p50/p90/max {q(ps, .1)}/{q(ps, .5)}/"
          f"{q(ps, .9)}/{ps[-1]}, output {q(os_, .1)}/{q(os_, .5)}/{q(os_, .9)}/{os_[-1]} tokens")  # fmt: skip
    slots = a.num_blocks * a.block_size
    print(f"budget: {a.num_blocks} blocks x {a.block_size} = {slots} token slots; max_model_len {a.max_model_len} "
          f"-> contiguous admits {slots // a.max_model_len} at once")  # fmt: skip
    if slots // a.max_model_len < 1:
        p.error("the budget holds no max_model_len request")
    paged = run_paged(trace, a.num_blocks, a.block_size, a.watermark, a.max_steps)
    contig = run_contiguous(trace, slots, a.max_model_len, a.max_steps)
    done = paged.steps < a.max_steps and contig.steps < a.max_steps
    headers = ["system", "slot use % (time-avg)", "mean of per-step %", "mean concurrent", "max concurrent",
               "steps", "preemptions"]  # fmt: skip
    print(table(headers, [paged.row("paged (KVCacheManager)"), contig.row("contiguous @ max_model_len")]))
    print(f"simulation took {paged.seconds:.1f} s (paged); {'complete' if done else 'CUT by --max-steps'}")
    use = paged.held / max(1, paged.reserved)
    conc = (paged.running_sum / paged.steps) / max(1e-9, contig.running_sum / contig.steps)
    goals = [
        goal("paged slot use >= 96%", use >= 0.96, f"{100 * use:.2f}%"),
        goal("paged concurrency >= 3x contiguous", conc >= 3.0, f"{conc:.2f}x mean concurrent requests"),
    ]
    if a.out:
        write_json(a.out, {**header, "args": vars(a), "columns": headers, "paged": paged.row("paged"),
                           "contiguous": contig.row("contiguous"), "goals": goals, "complete": done})  # fmt: skip
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
