"""Throughput of streamkv against transformers ``generate`` on the same model and workload.

One run, one load: the default GGUF (SmolLM2-135M-Instruct Q4_1, de-quantized
to fp32 by transformers) runs through

- our engine (continuous batching over the paged KV pool, chunked prefill,
  every request submitted at once, greedy, ``ignore_eos``), and
- transformers ``generate`` (greedy, static batches, left padding,
  ``min_new_tokens = max_new_tokens`` so each batch generates exactly its
  longest requested output).

Workloads (``--workload``):

- ``uniform``: 32 requests, 128-token prompts, exactly 128 new tokens each;
- ``mixed``: 64 requests, prompts 64-512 tokens, outputs 32-256 tokens, fixed
  seed; transformers runs them in static batches of 32 in the given order,
  padded, each batch generating its longest output (the surplus tokens of the
  shorter requests are wasted work and are not counted as output).

Prompts are random token ids from a fixed seed (``--prompts text`` slices real
text instead). Figures, per engine: output tokens/s with prefill included
(tokens / wall time), decode-only tokens/s (engine: steps where every sequence
decodes one token; transformers: from the first to the last generated token of
each batch), TTFT (arrival to first token; transformers: the batch's prefill).
Goal: streamkv >= 2x transformers on both workloads.

    .venv/bin/python load_tests/bench_throughput.py --workload both
    .venv/bin/python load_tests/bench_throughput.py --quick        # smoke run, small sizes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: make `load_tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from load_tests.bench_common_throughput import (  # noqa: E402
    EngineRun,
    Workload,
    blocks_needed,
    goal_line,
    greedy_agreement,
    load_models,
    machine_banner,
    make_llm,
    mixed_workload,
    run_engine,
    summarize,
    uniform_workload,
)
from load_tests.common import load_warning  # noqa: E402

GOAL_RATIO = 2.0


@dataclass(slots=True)
class HFRun:
    """transformers ``generate`` over static batches.

    Attributes:
        wall_s: sum of the batches' generate calls.
        output_tokens: requested (useful) output tokens.
        generated_tokens: tokens the batches generated (rows x longest output).
        decode_s: seconds from the first to the last generated token, summed over batches.
        decode_tokens: tokens generated inside those spans (rows x (new tokens - 1)).
        ttft_s: per request, its batch's time to first token.
        token_ids: useful output ids per request.
    """

    wall_s: float
    output_tokens: int
    generated_tokens: int
    decode_s: float
    decode_tokens: int
    ttft_s: list[float]
    token_ids: list[list[int]]

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else float("nan")


class _StepClock:
    """A logits processor that only records when each new token's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def run_hf(model: Any, workload: Workload, batch_size: int, pad_id: int) -> HFRun:
    """Static batches of ``batch_size`` in workload order, left padded, exactly the batch's longest output."""
    from transformers import LogitsProcessorList

    wall = decode_s = 0.0
    generated = decode_tokens = 0
    ttft: list[float] = []
    token_ids: list[list[int]] = []
    for lo in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[lo : lo + batch_size]
        olens = workload.output_lens[lo : lo + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        new = max(olens)
        clock = _StepClock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=pad_id,
                logits_processor=LogitsProcessorList([clock]),
                use_cache=True,
            )
        t1 = time.perf_counter()
        wall += t1 - t0
        generated += len(prompts) * new
        if len(clock.times) >= 2:
            decode_s += clock.times[-1] - clock.times[0]
            decode_tokens += len(prompts) * (len(clock.times) - 1)
        ttft += [clock.times[0] - t0] * len(prompts)
        for i, n in enumerate(olens):
            token_ids.append(out[i, width : width + n].tolist())
    return HFRun(wall, workload.num_output_tokens, generated, decode_s, decode_tokens, ttft, token_ids)


def bench_workload(models: Any, wl: Workload, args: argparse.Namespace) -> dict[str, Any]:
    print(f"--- workload {wl.describe()}", flush=True)
    num_blocks = blocks_needed(wl) + 16
    llm = make_llm(
        models.loaded, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        num_blocks=num_blocks,
    )  # fmt: skip
    tok = models.loaded.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else models.loaded.eos_token_ids[0]
    vocab = models.loaded.model.config.vocab_size

    # warm-ups on different prompts (oneDNN primitive caches, allocator, transformers' first-call costs)
    warm = uniform_workload(min(4, wl.num_requests), 32, 8, vocab, seed=wl.seed + 1000)
    run_engine(llm, warm)
    run_hf(models.hf_model, warm, args.hf_batch_size, pad_id)

    eng: EngineRun | None = None
    hf: HFRun | None = None
    for _ in range(args.repeats):  # best of N: contention only ever slows a run down
        e = run_engine(llm, wl)
        if eng is None or e.wall_s < eng.wall_s:
            eng = e
        if not args.skip_hf:
            h = run_hf(models.hf_model, wl, args.hf_batch_size, pad_id)
            if hf is None or h.wall_s < hf.wall_s:
                hf = h
    assert eng is not None
    assert eng.output_tokens == wl.num_output_tokens, (eng.output_tokens, wl.num_output_tokens)
    n_prefill_steps = sum(1 for s in eng.steps if not s.pure_decode)
    print(
        f"  streamkv      : {eng.output_tok_s:8.1f} output tok/s (prefill incl.; {eng.output_tokens} tokens in "
        f"{eng.wall_s:.2f} s, {len(eng.steps)} steps of which {n_prefill_steps} carry prefill)"
    )
    print(
        f"                  {eng.decode_tok_s:8.1f} decode tok/s (pure-decode steps), "
        f"{eng.decode_tok_s_full_batch:.1f} at the full decode batch; TTFT {summarize(eng.ttft_s)}"
    )
    row: dict[str, Any] = {
        "workload": wl.name,
        "describe": wl.describe(),
        "streamkv": {
            "output_tok_s": eng.output_tok_s, "decode_tok_s": eng.decode_tok_s,
            "decode_tok_s_full_batch": eng.decode_tok_s_full_batch, "wall_s": eng.wall_s,
            "steps": len(eng.steps), "prefill_steps": n_prefill_steps,
            "ttft_mean_s": sum(eng.ttft_s) / len(eng.ttft_s), "ttft_max_s": max(eng.ttft_s),
        },
    }  # fmt: skip
    if hf is not None:
        print(
            f"  transformers  : {hf.output_tok_s:8.1f} output tok/s (prefill incl.; {hf.output_tokens} useful of "
            f"{hf.generated_tokens} generated, {hf.wall_s:.2f} s, static batches of {args.hf_batch_size})"
        )
        print(f"                  {hf.decode_tok_s:8.1f} decode tok/s; TTFT {summarize(hf.ttft_s)}")
        ratio = eng.output_tok_s / hf.output_tok_s
        dratio = eng.decode_tok_s / hf.decode_tok_s
        exact, prefix = greedy_agreement(eng.token_ids, hf.token_ids)
        print(f"  ratio streamkv/transformers: {ratio:.2f}x output tok/s, {dratio:.2f}x decode tok/s")
        print(f"  greedy agreement: {exact:.0%} of requests identical, {prefix:.0%} mean common prefix")
        print("  " + goal_line(f"{wl.name} output tok/s vs transformers", ratio, GOAL_RATIO))
        row["transformers"] = {
            "output_tok_s": hf.output_tok_s, "decode_tok_s": hf.decode_tok_s, "wall_s": hf.wall_s,
            "generated_tokens": hf.generated_tokens, "ttft_mean_s": sum(hf.ttft_s) / len(hf.ttft_s),
            "ttft_max_s": max(hf.ttft_s),
        }  # fmt: skip
        row["ratio_output"] = ratio
        row["ratio_decode"] = dratio
        row["greedy_exact"] = exact
        row["greedy_prefix"] = prefix
    print(flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("uniform", "mixed", "both"), default="both")
    p.add_argument("--quick", action="store_true", help="smoke sizes: 8 requests, short prompts and outputs")
    p.add_argument("--prompts", choices=("random", "text"), default="random", help="prompt token source")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per engine; the fastest is reported")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--hf-batch-size", type=int, default=None, help="transformers static batch (default 32; quick 8)")
    p.add_argument("--skip-hf", action="store_true", help="engine only")
    p.add_argument("--out", "--json", dest="out", type=Path, default=None, help="write every figure to this JSON file")
    args = p.parse_args(argv)
    if args.hf_batch_size is None:
        args.hf_batch_size = 8 if args.quick else 32

    info = machine_banner(args.threads, "streamkv vs transformers generate: throughput", "load_tests.bench_throughput")
    models = load_models(want_hf=not args.skip_hf)
    print(f"model: {models.gguf_path} (fp32 after de-quantization), loaded in {models.load_s:.1f} s\n", flush=True)
    vocab = models.loaded.model.config.vocab_size
    tok = models.loaded.tokenizer
    workloads: list[Workload] = []
    if args.workload in ("uniform", "both"):
        n, pl, ol = (8, 32, 16) if args.quick else (32, 128, 128)
        workloads.append(uniform_workload(n, pl, ol, vocab, args.seed, args.prompts, tok))
    if args.workload in ("mixed", "both"):
        n, pr, orr = (16, (16, 64), (8, 32)) if args.quick else (64, (64, 512), (32, 256))
        workloads.append(mixed_workload(n, pr, orr, vocab, args.seed, args.prompts, tok))

    rows = [bench_workload(models, wl, args) for wl in workloads]
    note = load_warning(info)
    if note:
        print("NOTE: " + note)
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": info, "contention": note, "rows": rows}, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
