"""Physical limit: the model's own matmuls alone, against the engine's steady-state decode.

1. Ceiling. One decode step's linear layers, nothing else: for every one of
   the 30 layers its qkv, o, gate_up and down projections, then the LM head,
   using the weight tensors of our loaded model, in a tight loop (no
   attention, no norms, no Python around them but the loop). Timed up to
   three ways: plain ``F.linear`` on the dense weights (MKL; fp32 only),
   oneDNN's prepacked ``_linear_pointwise`` (fp32 and bf16), and each
   projection's own ``Linear.forward`` plus the LM head as a greedy step runs
   it (the kernel the engine picks for that batch: the small-batch kernel, the
   int8 kernel, or oneDNN; a float32 model's head is its greedy head where that
   takes the rows, ``streamkv/model/greedy_head.py``). The fastest is the ceiling for the dtype: ``batch / seconds per
   step`` tokens/s. ``--dtype`` / ``--quantization`` choose the model.
2. Engine. ``batch`` requests of ``--context`` random tokens go in at once;
   after their prefill, ``--warmup-steps`` decode steps are skipped and
   ``--decode-steps`` pure-decode steps are timed. Reported as tokens/s and as
   a fraction of the ceiling. Goal: >= 80% at batch 32 (issue #13).
3. Where one decode step's time goes (batch ``--breakdown-batch``): every
   stage of ``EngineCore.step`` timed by wrapping it on this instance
   (scheduler.schedule, AttentionMetadata.build, the rest of the runner's input
   build, the forward split into linear / attention / norms / RoPE /
   activation / the rest, compute_logits, sampling, scheduler.update, token
   append with detokenization, output emission), the attention of one layer
   split into its stages, then torch.profiler's top ops and cProfile's top
   Python functions (``step_breakdown.py``). Nothing in ``streamkv`` is
   edited; wrappers are removed afterwards.

    .venv/bin/python load_tests/bench_limit.py                 # batches 1, 32, 128 + breakdown at 32
    .venv/bin/python load_tests/bench_limit.py --dtype bfloat16 --batches 1,32,64 --no-profile
    .venv/bin/python load_tests/bench_limit.py --quick         # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: make `load_tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from load_tests.bench_common_throughput import (  # noqa: E402
    goal_line,
    load_models,
    machine_banner,
)
from load_tests.common import load_warning  # noqa: E402
from load_tests.step_breakdown import (  # noqa: E402
    DecodeHarness,
    attention_stages,
    print_breakdown,
    python_profile,
    step_breakdown,
    torch_profile,
)

GOAL_FRACTION = 0.80  # issue #13: B=32 decode >= 80% of the linear-layer ceiling for its dtype


# ------------------------------------------------------------------ ceiling


PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def linear_weights(dense_model: Any) -> list[torch.Tensor]:
    """The dense fp32 weights of one decode step's matmuls, in execution order."""
    dense: list[torch.Tensor] = []
    for layer in dense_model.model.layers:
        for name in PROJECTIONS:
            m = layer.get_submodule(name)
            assert m.bias is None, "the ceiling loop assumes bias-free projections (Llama/SmolLM2)"
            dense.append(m.weight)
    dense.append(dense_model.model.embed_tokens.weight if dense_model.lm_head is None else dense_model.lm_head)
    return dense


def packed_weights(model: Any) -> list[torch.Tensor] | None:
    """oneDNN's packed copies in execution order; ``None`` when the model has none (int8 on its kernel)."""
    packed = [layer.get_submodule(name).packed_weight for layer in model.model.layers for name in PROJECTIONS]
    packed.append(model.packed_lm_head)
    return None if any(w is None for w in packed) else packed


def time_loop(fn: Callable[[], None], min_s: float, min_iters: int) -> tuple[float, float]:
    """(median, fastest) seconds of one ``fn()`` call (after two warm-up calls)."""
    fn()
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - start < min_s:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times)


def engine_matmuls(model: Any) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """One decode step's matmuls as the engine calls them: each projection's forward, then the LM head."""
    calls: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]] = []
    for layer in model.model.layers:
        for name in PROJECTIONS:
            m = layer.get_submodule(name)
            calls.append((m.forward, m.in_features))
    calls.append((partial(lm_head, model), model.config.hidden_size))
    return calls


def lm_head(model: Any, h: torch.Tensor) -> torch.Tensor:
    """A greedy decode step's LM head as the runner runs it: the greedy head (``GreedyHead``, a float32 model's
    bf16 estimate and exact candidates) where it takes the rows, else the logits."""
    return model.compute_logits(h, widen=False) if model.greedy_tokens(h) is None else h


@torch.inference_mode()
def linear_ceiling(
    dense_w: list[torch.Tensor] | None,
    packed_w: list[torch.Tensor] | None,
    engine: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]],
    dtype: torch.dtype,
    n_params: int,
    weight_bytes: int,
    batch: int,
    min_s: float,
) -> dict:
    """Median and fastest time of one step's matmuls, each way that applies; the fastest way is the ceiling."""
    xs = {k: torch.randn(batch, k).to(dtype) for _, k in engine}
    pointwise = torch.ops.mkldnn._linear_pointwise
    calls: dict[str, list[tuple[Callable[..., Any], tuple[Any, ...]]]] = {}
    if dense_w is not None:
        calls["dense"] = [(F.linear, (xs[w.shape[1]].float(), w)) for w in dense_w]
    if packed_w is not None:
        calls["packed"] = [
            (pointwise, (xs[k], w, None, "none", [], "")) for (_, k), w in zip(engine, packed_w, strict=True)
        ]
    calls["engine"] = [(fn, (xs[k],)) for fn, k in engine]

    def runner(way: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> Callable[[], None]:
        def run() -> None:
            for fn, fn_args in way:
                fn(*fn_args)

        return run

    ways = {name: runner(way) for name, way in calls.items()}
    times = {name: time_loop(fn, min_s, 5) for name, fn in ways.items()}
    t = min(median for median, _ in times.values())
    return {
        "batch": batch,
        **{f"{name}_ms": median * 1e3 for name, (median, _) in times.items()},
        "ceiling_by": min(times, key=lambda name: times[name][0]),
        "ceiling_tok_s": batch / t,
        "ceiling_tok_s_best": batch / min(best for _, best in times.values()),
        "gflop_s": 2 * batch * n_params / t / 1e9,
        "weight_gb_s": weight_bytes / t / 1e9,
    }


# ------------------------------------------------------------ engine decode


def engine_decode(loaded: Any, batch: int, context: int, warmup: int, steps: int, seed: int) -> dict:
    h = DecodeHarness(loaded, batch, context, warmup + steps, seed)
    for _ in range(warmup):
        h.step()
    ctx0 = h.context_len()
    times = [h.step() for _ in range(steps)]
    return {
        "batch": batch,
        "context": f"{ctx0}-{h.context_len()}",
        "step_ms_median": statistics.median(times) * 1e3,
        "decode_tok_s": batch * steps / sum(times),
        "decode_tok_s_median_step": batch / statistics.median(times),
        "decode_tok_s_best_step": batch / min(times),
    }


# --------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default=None, help="comma-separated decode batches (default 1,32,128; quick 1,8)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens per sequence (default 128; quick 32)")
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (default 32; quick 6)")
    p.add_argument(
        "--breakdown-batch", type=int, default=None, help="batch of the step breakdown (default 32; quick 8)"
    )
    p.add_argument("--breakdown-steps", type=int, default=None, help="instrumented steps (default 10; quick 3)")
    p.add_argument("--min-seconds", type=float, default=None, help="timing window per ceiling (default 2; quick 0.3)")
    p.add_argument("--no-profile", action="store_true", help="skip torch.profiler and cProfile tables")
    p.add_argument("--quick", action="store_true", help="smoke sizes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the engine model's dtype")
    p.add_argument("--quantization", choices=("int8",), default=None, help="int8 weights (--quantization int8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", "--json", dest="out", type=Path, default=None, help="write every figure to this JSON file")
    args = p.parse_args(argv)
    q = args.quick
    batches = [int(x) for x in (args.batches or ("1,8" if q else "1,32,128")).split(",")]
    context = args.context or (32 if q else 128)
    decode_steps = args.decode_steps or (6 if q else 32)
    bd_batch = args.breakdown_batch or (8 if q else 32)
    bd_steps = args.breakdown_steps or (3 if q else 10)
    min_s = args.min_seconds or (0.3 if q else 2.0)

    info = machine_banner(
        args.threads, "physical limit: linear layers alone vs engine decode", "load_tests.bench_limit"
    )
    dtype = getattr(torch, args.dtype)
    fp32 = dtype == torch.float32 and args.quantization is None
    models = load_models(want_dense=fp32, dtype=dtype, quantization=args.quantization)
    mode = args.dtype + (f", {args.quantization} weights" if args.quantization else "")
    print(f"model: {models.gguf_path} ({mode}), loaded in {models.load_s:.1f} s\n", flush=True)
    model = models.loaded.model
    engine = engine_matmuls(model)
    dense_w = linear_weights(models.dense.model) if models.dense is not None else None
    packed_w = packed_weights(model)
    head = model.model.embed_tokens.weight
    n_params = sum(m.in_features * m.out_features for m in model.modules() if hasattr(m, "in_features"))
    n_params += head.shape[0] * head.shape[1]
    weight_bytes = n_params * (1 if args.quantization else dtype.itemsize)
    print(
        f"one decode step's matmuls: {len(engine)} ({len(engine) - 1} projections + LM head), "
        f"{n_params / 1e6:.1f} M parameters, {weight_bytes / 1e6:.0f} MB as run, {2 * n_params / 1e6:.0f} MFLOP/token\n"
    )
    rows = []
    print(f"{'batch':>5s} {'F.linear ms':>12s} {'oneDNN ms':>10s} {'engine ms':>10s} {'ceiling tok/s':>14s} "
          f"{'GFLOP/s':>8s} {'weights GB/s':>12s} | {'engine tok/s':>12s} {'median step ms':>14s} "
          f"{'context':>9s} {'of ceiling':>10s}")  # fmt: skip
    for b in batches:
        c = linear_ceiling(dense_w, packed_w, engine, dtype, n_params, weight_bytes, b, min_s)
        e = engine_decode(models.loaded, b, context, args.warmup_steps, decode_steps, args.seed)
        # median step against the median ceiling loop: like for like, and robust to a stalled step
        frac = e["decode_tok_s_median_step"] / c["ceiling_tok_s"]
        frac_best = e["decode_tok_s_best_step"] / c["ceiling_tok_s_best"]
        rows.append({**c, **{f"engine_{k}": v for k, v in e.items()}, "fraction": frac, "fraction_best": frac_best})
        ms = " ".join(f"{c[k]:{w}.2f}" if k in c else f"{'-':>{w}s}" for k, w in (("dense_ms", 12), ("packed_ms", 10),
                                                                               ("engine_ms", 10)))  # fmt: skip
        print(
            f"{b:5d} {ms} {c['ceiling_tok_s']:14.1f} {c['gflop_s']:8.1f} "
            f"{c['weight_gb_s']:12.1f} | {e['decode_tok_s']:12.1f} {e['step_ms_median']:14.2f} {e['context']:>9s} "
            f"{frac:10.1%}  (best vs best: {e['decode_tok_s_best_step']:.0f} of {c['ceiling_tok_s_best']:.0f} tok/s"
            f" = {frac_best:.0%})",
            flush=True,
        )
    print("(engine tok/s: all timed steps; the fraction: median step vs median ceiling loop, the fastest of the\n"
          " F.linear / oneDNN / engine-kernel loops; best vs best: fastest step vs fastest loop, the steadier\n"
          " figure when other work shares the CPU)\n")  # fmt: skip
    for r in rows:
        if r["batch"] == 32:
            print(goal_line("decode at batch 32 as a fraction of the linear-layer ceiling", r["fraction"] * 100,
                            GOAL_FRACTION * 100, unit="%"))  # fmt: skip
    print()

    bd = step_breakdown(models.loaded, bd_batch, context, bd_steps, args.seed)
    print_breakdown(bd)
    h = bd.pop("harness")
    print()
    stages = attention_stages(h, reps=20 if not q else 5)
    print(f"--- one layer's decode attention at batch {bd_batch} (replica of torch_paged._decode), ms per layer:")
    if not stages:
        print("  (not run: the replica is the fp32 torch path, this model's KV cache is not fp32)")
    for k, v in stages.items():
        print(f"  {k:50s} {v:8.3f}" + ("" if "MB" in k else f"   x30 layers = {v * 30:.2f} ms/step"))
    profiles = {}
    if not args.no_profile:
        print(f"\n--- torch.profiler, {bd_steps} decode steps at batch {bd_batch}, top ops by self CPU time:")
        profiles["torch"] = torch_profile(h, bd_steps, 22)
        print(profiles["torch"])
        print(f"--- cProfile, {bd_steps} decode steps at batch {bd_batch}, top functions by own time:")
        profiles["python"] = python_profile(h, bd_steps, 25)
        print(profiles["python"])
    note = load_warning(info)
    if note:
        print("NOTE: " + note)
    if args.out is not None:
        out = {"machine": info, "contention": note, "rows": rows, "breakdown": bd, "attention_stages": stages}
        args.out.write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
