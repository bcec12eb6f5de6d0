"""streamkv's rows for the peer table of issue #13, plus a step breakdown at batch 32.

One load of the default GGUF (SmolLM2-135M-Instruct) builds our model in each
``--dtypes`` entry (fp32, bf16). For every dtype and batch size (``--batches``,
default 1, 8, 32, 64) the engine runs B requests of 128 random-token prompts
and exactly 128 new tokens (greedy, ``ignore_eos``, every request submitted at
once, prefix caching off), ``--repeats`` times; the median run is reported:

- output tok/s (prefill included), decode tok/s (pure-decode steps), mean TTFT;
- greedy agreement with transformers fp32 ``generate`` on prompt 0: the number
  of leading tokens (of 128) that match.

Then one more batch-32 run per dtype is instrumented (wrappers set on the
instances and removed afterwards; nothing in ``streamkv/`` changes) to split a
decode step into linear layers, attention, LM head, sampling, other model ops
(norms, RoPE, SiLU, embedding, residual adds) and Python/scheduler (the rest of
``EngineCore.step``).

    .venv/bin/python -m load_tests.bench_engine_rows                        # the lead's quiet run (2 threads)
    .venv/bin/python -m load_tests.bench_engine_rows --threads 1 --batches 32 --repeats 1
    .venv/bin/python -m load_tests.bench_engine_rows --attention-backend torch   # the reference path, for A/B
    .venv/bin/python -m load_tests.bench_engine_rows --fused on,off   # fused C++ layer ops vs torch ops (#13 item 3)

With several variants (``--dtypes`` x ``--fused``) the rows run batch by batch,
every variant at a batch before the next batch, so load drifts hit them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from bench_common_throughput import (  # noqa: E402
    blocks_needed,
    machine_banner,
    run_engine,
    uniform_workload,
)
from common import load_warning  # noqa: E402

PROMPT_LEN = OUTPUT_LEN = 128
STAGES = ("linear", "attention", "lm_head", "sampling", "other_model", "python_scheduler")


def load(dtypes: list[str], fused: list[str]) -> tuple[dict[str, Any], Any]:
    """Our model per (dtype, fused on/off) variant, keyed by its label, and transformers' fp32 model."""
    import transformers

    from streamkv.model.loader import from_hf, load_hf_checkpoint

    transformers.utils.logging.disable_progress_bar()
    with contextlib.redirect_stderr(io.StringIO()):  # GGUF de-quantization draws a tqdm bar
        ckpt = load_hf_checkpoint(None, torch.float32)
    models = {
        d if len(fused) == 1 else f"{d}, fused {f}": from_hf(
            ckpt, getattr(torch, d), torch.device("cpu"), fused=f == "on"
        )
        for d in dtypes
        for f in fused
    }
    return models, ckpt.model


def hf_reference(hf_model: Any, prompt: list[int]) -> list[int]:
    """transformers fp32 greedy continuation of ``prompt`` (OUTPUT_LEN tokens)."""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def make_llm(loaded: Any, batch: int, backend: str, num_blocks: int) -> Any:
    from streamkv.llm import LLM

    return LLM(
        loaded=loaded, device="cpu", attention_backend=backend, max_num_seqs=max(batch, 1),
        max_num_batched_tokens=2048, num_blocks=num_blocks, enable_prefix_caching=False,
    )  # fmt: skip


@contextlib.contextmanager
def stage_timers(llm: Any) -> Iterator[dict[str, float]]:
    """Accumulate seconds per stage while the block runs; the instance wrappers go away afterwards."""
    from streamkv.model.linear import Linear

    totals: dict[str, float] = defaultdict(float)
    core = llm.core
    model = core.runner.model
    undo: list[Callable[[], None]] = []

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[name] += time.perf_counter() - t0

        return wrapper

    def patch(obj: Any, attr: str, name: str) -> None:
        had = attr in vars(obj) if hasattr(obj, "__dict__") else False
        original = getattr(obj, attr)
        setattr(obj, attr, timed(name, original))
        undo.append(lambda: setattr(obj, attr, original) if had else delattr(obj, attr))

    for module in model.modules():
        if isinstance(module, Linear):
            patch(module, "forward", "linear")
    patch(core.runner.backend, "forward", "attention")
    patch(model, "compute_logits", "lm_head")
    patch(model, "greedy_tokens", "lm_head")  # a greedy step's LM head (GreedyHead), when it takes the rows
    patch(model, "forward", "model_forward")
    patch(core, "step", "step")
    sampler_home = sys.modules.get(type(core).__module__)
    if sampler_home is not None and hasattr(sampler_home, "sample_batch"):
        original_sample = sampler_home.sample_batch
        sampler_home.sample_batch = timed("sampling", original_sample)
        undo.append(lambda: setattr(sampler_home, "sample_batch", original_sample))
    try:
        yield totals
    finally:
        for fn in reversed(undo):
            fn()


def breakdown(llm: Any, workload: Any) -> dict[str, float]:
    """ms per pure-decode step by stage, from the decode steps of one instrumented run."""
    core = llm.core
    decode_totals: dict[str, float] = defaultdict(float)
    steps = 0
    original_forward = core.runner.forward
    with stage_timers(llm) as totals:
        state: dict[str, Any] = {}

        def forward(out: Any) -> Any:
            state["pure"] = out.num_batched_tokens == len(out.scheduled) and len(out.scheduled) == workload.num_requests
            state["before"] = dict(totals)
            return original_forward(out)

        core.runner.forward = forward
        from streamkv.sampling_params import SamplingParams

        sinks: list[Any] = []
        for i, prompt in enumerate(workload.prompts):
            params = SamplingParams(temperature=0.0, max_tokens=workload.output_lens[i], ignore_eos=True)
            core.add_request(f"breakdown-{i}", prompt, params, sinks.append)
        while core.has_work():
            state.clear()
            before_step = dict(totals)
            core.step()
            if state.get("pure"):
                steps += 1
                for k, v in totals.items():
                    decode_totals[k] += v - before_step.get(k, 0.0)
        del core.runner.forward
    if not steps:
        return {}
    per = {k: v / steps * 1e3 for k, v in decode_totals.items()}
    out = {
        "linear": per.get("linear", 0.0),
        "attention": per.get("attention", 0.0),
        "lm_head": per.get("lm_head", 0.0),
        "sampling": per.get("sampling", 0.0),
    }
    out["other_model"] = per.get("model_forward", 0.0) - out["linear"] - out["attention"]
    out["python_scheduler"] = per.get("step", 0.0) - per.get("model_forward", 0.0) - out["lm_head"] - out["sampling"]
    out["step"] = per.get("step", 0.0)
    out["decode_steps"] = steps
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2; 1 on a shared machine)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row; the median is reported")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "cpu"))
    p.add_argument("--fused", default="on", help="comma list of on/off: fused C++ layer ops or the torch ops")
    p.add_argument("--breakdown-batch", type=int, default=32, help="0 skips the step breakdown")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers reference (agreement shows n/a)")
    p.add_argument("--out", type=Path, default=None, help="write every figure to this JSON file")
    args = p.parse_args(argv)

    info = machine_banner(args.threads, "streamkv rows: B x 128 in / 128 out, greedy", "load_tests.bench_engine_rows")
    dtypes = args.dtypes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    models, hf_model = load(dtypes, args.fused.split(","))
    print(f"loaded {', '.join(dtypes)} in {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = next(iter(models.values())).model.config.vocab_size
    workloads = {b: uniform_workload(b, PROMPT_LEN, OUTPUT_LEN, vocab, seed=0) for b in batches}
    prompt0 = workloads[max(batches)].prompts[0]  # every workload draws the same first prompt from seed 0
    reference = None if args.no_hf else hf_reference(hf_model, prompt0)
    del hf_model

    rows: list[dict[str, Any]] = []
    print("| engine | B | output tok/s | decode tok/s | TTFT mean | greedy = transformers fp32 (prompt 0) |")
    print("|---|---|---|---|---|---|")
    for b in batches:
        for dtype, loaded in models.items():
            wl = workloads[b]
            llm = make_llm(loaded, b, args.attention_backend, blocks_needed(wl) + 8)
            run_engine(llm, uniform_workload(min(b, 4), 32, 8, vocab, seed=1000))  # warm-up
            runs = sorted((run_engine(llm, wl) for _ in range(args.repeats)), key=lambda r: r.output_tok_s)
            run = runs[len(runs) // 2]
            assert wl.prompts[0] == prompt0 and run.output_tokens == wl.num_output_tokens
            agree = None
            if reference is not None:
                got = run.token_ids[0]
                pairs = enumerate(zip(got, reference, strict=False))
                agree = next((i for i, (x, y) in pairs if x != y), len(reference))
            ttft = statistics.fmean(run.ttft_s)
            name = f"streamkv {dtype} ({llm.core.backend.name} attention)"
            agree_s = "n/a" if agree is None else f"{agree}/{OUTPUT_LEN}"
            print(
                f"| {name} | {b} | {run.output_tok_s:.1f} | {run.decode_tok_s:.1f} | {ttft:.2f} s | {agree_s} |",
                flush=True,
            )
            rows.append({
                "dtype": dtype, "batch": b, "backend": llm.core.backend.name, "output_tok_s": run.output_tok_s,
                "decode_tok_s": run.decode_tok_s, "ttft_mean_s": ttft, "greedy_agree_prompt0": agree,
                "all_output_tok_s": [r.output_tok_s for r in runs],
            })  # fmt: skip

    breakdowns: dict[str, dict[str, float]] = {}
    if args.breakdown_batch:
        b = args.breakdown_batch
        wl = uniform_workload(b, PROMPT_LEN, OUTPUT_LEN, vocab, seed=0)
        print(f"\nstep breakdown, batch {b}, ms per pure-decode step (share of the step):")
        print("| dtype | " + " | ".join(STAGES) + " | step |")
        print("|---|" + "---|" * (len(STAGES) + 1))
        for dtype, loaded in models.items():
            llm = make_llm(loaded, b, args.attention_backend, blocks_needed(wl) + 8)
            run_engine(llm, uniform_workload(4, 32, 8, vocab, seed=1000))
            br = breakdown(llm, wl)
            breakdowns[dtype] = br
            step = br.get("step", float("nan"))
            cells = [f"{br[s]:.2f} ({br[s] / step:.0%})" for s in STAGES]
            print(f"| {dtype} | " + " | ".join(cells) + f" | {step:.2f} |", flush=True)
    note = load_warning(info)
    if note:
        print("NOTE: " + note)
    if args.out is not None:
        doc = {"machine": info, "contention": note, "rows": rows, "breakdown": breakdowns}
        args.out.write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
