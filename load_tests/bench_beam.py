"""Beam search blocks: physical blocks (shared, copy-on-write) over logical blocks, against contiguous copies.

In-process ``EngineCore`` stepped here, one beam-search request at a time
(``--beam-width`` beams, ``--max-tokens`` new tokens, chat prompts). After
every step, over the request's live beams:

- *physical*: distinct blocks their block tables hold (what the pool spends);
- *logical*: the sum of their block-table lengths (each beam's own paged copy);
- *contiguous*: tokens ``beam_width x (prompt + generated)`` (a KV cache of
  one contiguous copy per beam, as transformers keeps and reorders it), in
  blocks, and ``beam_width x (prompt + max_tokens)`` for a static cache
  reserved up front.

Reported per prompt: the peak and the step-average of physical / logical and
physical / contiguous, copy-on-write copies, and ms per step and per beam
token, next to greedy decoding of the same prompt (interleaved, same engine).

    python -m load_tests.bench_beam                      # SmolLM2-135M
    python -m load_tests.bench_beam --model tiny         # smoke
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: make `load_tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from load_tests.common import add_model_args, goal, load, make_parser, mean, print_header, table, write_json

QUESTIONS = [
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "Name three primary colors.",
    "Give me a short story about a robot learning to paint.",
    "What are the benefits of regular exercise?",
    "How do airplanes stay in the air?",
]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def run_beam(core: Any, rid: str, prompt: list[int], params: Any) -> dict[str, Any]:
    outs: list[Any] = []
    core.add_request(rid, prompt, params, outs.append)
    bs, k = core.block_size, params.beam_width
    cow0 = core.kv.pool.counters.cow_copies
    steps: list[tuple[int, int, int]] = []  # (physical, logical, contiguous tokens)
    t0 = time.perf_counter()
    num_steps = 0
    while core.has_work():
        core.step()
        num_steps += 1
        group = core.beams.groups.get(rid)
        if group is None:
            continue
        tables = [core.kv.block_table(b.seq.seq_id) for b in group.beams]
        physical = len({block for t in tables for block in t})
        logical = sum(len(t) for t in tables)
        contiguous = k * group.beams[0].seq.num_tokens
        steps.append((physical, logical, contiguous))
    wall = time.perf_counter() - t0
    core.check_invariants()
    whole = core.kv.num_free_blocks == core.num_blocks
    (final,) = outs
    beam_tokens = sum(len(d.token_ids) for d in final.deltas)
    ratios_l = [p / lg for p, lg, _ in steps if lg]
    ratios_c = [p / cdiv(c, bs) for p, _, c in steps]
    peak = max(steps, key=lambda s: s[0]) if steps else (0, 0, 0)
    static_blocks = k * cdiv(len(prompt) + params.max_tokens, bs)
    return {"prompt_tokens": len(prompt), "steps": num_steps, "new_tokens": len(final.deltas[0].token_ids),
            "peak_physical": peak[0], "logical_at_peak": peak[1], "contiguous_blocks_at_peak": cdiv(peak[2], bs),
            "static_blocks": static_blocks, "mean_physical_over_logical": mean(ratios_l),
            "mean_physical_over_contiguous": mean(ratios_c), "cow_copies": core.kv.pool.counters.cow_copies - cow0,
            "wall_s": wall, "ms_per_step": 1000 * wall / max(num_steps, 1), "returned_tokens": beam_tokens,
            "pool_whole": whole}  # fmt: skip


def run_greedy(core: Any, rid: str, prompt: list[int], max_tokens: int) -> float:
    from streamkv.sampling_params import SamplingParams

    outs: list[Any] = []
    core.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), outs.append)
    t0 = time.perf_counter()
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
    return 1000 * (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    p = make_parser(__doc__)
    add_model_args(p)
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=len(QUESTIONS), help=f"chat prompts (at most {len(QUESTIONS)})")
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--ignore-eos", action="store_true", help="every hypothesis runs to --max-tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", default=None, help="JSON results")
    a = p.parse_args(argv)
    loaded = load(a.model, a.threads)
    header = print_header(f"bench_beam: beam_width {a.beam_width}, blocks shared vs copied", "load_tests.bench_beam")
    from streamkv.llm import LLM
    from streamkv.model.chat import ChatFormatter
    from streamkv.sampling_params import SamplingParams

    chat = ChatFormatter(loaded.tokenizer)
    prompts = [chat.first_turn(q) for q in QUESTIONS[: a.prompts]]
    need = a.beam_width * cdiv(max(map(len, prompts)) + a.max_tokens, a.block_size)
    llm = LLM(loaded=loaded, device="cpu", num_blocks=2 * need, block_size=a.block_size, enable_prefix_caching=False)
    params = SamplingParams(n=1, temperature=0, max_tokens=a.max_tokens, beam_width=a.beam_width,
                            length_penalty=a.length_penalty, ignore_eos=a.ignore_eos)  # fmt: skip
    results = []
    for i, prompt in enumerate(prompts):
        r = run_beam(llm.core, f"beam-{i}", prompt, params)
        r["greedy_ms_per_step"] = run_greedy(llm.core, f"greedy-{i}", prompt, a.max_tokens)
        results.append(r)
    rows = [[i, r["prompt_tokens"], r["new_tokens"], r["peak_physical"], r["logical_at_peak"],
             r["contiguous_blocks_at_peak"], r["static_blocks"], r["peak_physical"] / max(r["logical_at_peak"], 1),
             r["mean_physical_over_logical"], r["mean_physical_over_contiguous"], r["cow_copies"], r["ms_per_step"],
             r["greedy_ms_per_step"], r["pool_whole"]] for i, r in enumerate(results)]  # fmt: skip
    print(table(["prompt", "prompt tok", "best new tok", "peak physical", "logical at peak", "contiguous at peak",
                 "static copies", "peak phys/logical", "mean phys/logical", "mean phys/contiguous", "COW copies",
                 "beam ms/step", "greedy ms/step", "pool whole"], rows, digits=2))  # fmt: skip
    total_p = sum(r["peak_physical"] for r in results)
    total_l = sum(r["logical_at_peak"] for r in results)
    print(f"overall at the peaks: {total_p} physical / {total_l} logical blocks = {total_p / max(total_l, 1):.2f}; "
          f"mean over steps {mean([r['mean_physical_over_logical'] for r in results]):.2f}")  # fmt: skip
    goals = [
        goal("physical blocks < beam_width x logical blocks of one beam, at every peak",
             all(r["peak_physical"] < r["logical_at_peak"] for r in results), f"{total_p} vs {total_l}"),
        goal("pool whole after every request", all(r["pool_whole"] for r in results), "all blocks free"),
    ]  # fmt: skip
    if a.out:
        write_json(a.out, {**header, "args": vars(a), "goals": goals, "runs": results})
    return 0 if all(g["passed"] for g in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
