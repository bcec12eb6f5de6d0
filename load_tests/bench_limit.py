"""Physical limit: the model's own matmuls alone, against the engine's steady-state decode.

1. Ceiling. One decode step's linear layers, nothing else: for every one of
   the 30 layers its qkv, o, gate_up and down projections, then the LM head,
   using the weight tensors of our loaded model, in a tight loop (no
   attention, no norms, no Python around them but the loop). Timed two ways:
   plain ``F.linear`` on the dense weights (MKL) and oneDNN's prepacked
   ``_linear_pointwise`` (what the engine runs on the CPU). The faster one is
   the ceiling: ``batch / seconds per step`` tokens/s.
2. Engine. ``batch`` requests of ``--context`` random tokens go in at once;
   after their prefill, ``--warmup-steps`` decode steps are skipped and
   ``--decode-steps`` pure-decode steps are timed. Reported as tokens/s and as
   a fraction of the ceiling. Goal: >= 70% at batch 32.
3. Where one decode step's time goes (batch ``--breakdown-batch``): every
   stage of ``EngineCore.step`` timed by wrapping it on this instance
   (scheduler.schedule, AttentionMetadata.build, the rest of the runner's input
   build, the forward split into linear / attention / norms / RoPE /
   activation / the rest, compute_logits, sampling, scheduler.update, token
   append with detokenization, output emission), the attention of one layer
   split into its stages, then torch.profiler's top ops and cProfile's top
   Python functions. Nothing in ``streamkv`` is edited; wrappers are removed
   afterwards.

    .venv/bin/python load_tests/bench_limit.py                 # batches 1, 32, 128 + breakdown at 32
    .venv/bin/python load_tests/bench_limit.py --quick         # smoke run
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_common_throughput import (  # noqa: E402
    goal_line,
    load_models,
    load_warning,
    machine_banner,
    make_llm,
    make_prompts,
)

GOAL_FRACTION = 0.70


# ------------------------------------------------------------------ ceiling


def linear_weights(dense_model: Any, packed_model: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The dense and the oneDNN-packed weights of one decode step's matmuls, in execution order."""
    dense: list[torch.Tensor] = []
    packed: list[torch.Tensor] = []
    for dl, pl in zip(dense_model.model.layers, packed_model.model.layers, strict=True):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            d, p = dl.get_submodule(name), pl.get_submodule(name)
            assert d.bias is None, "the ceiling loop assumes bias-free projections (Llama/SmolLM2)"
            dense.append(d.weight)
            packed.append(p.packed_weight if p.packed_weight is not None else p.weight)
    head = dense_model.model.embed_tokens.weight if dense_model.lm_head is None else dense_model.lm_head
    dense.append(head)
    packed.append(packed_model.packed_lm_head if packed_model.packed_lm_head is not None else head)
    return dense, packed


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


@torch.inference_mode()
def linear_ceiling(dense_w: list[torch.Tensor], packed_w: list[torch.Tensor], batch: int, min_s: float) -> dict:
    xs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in dense_w}
    dense_args = [(xs[w.shape[1]], w) for w in dense_w]
    packed_args = [(xs[d.shape[1]], p) for d, p in zip(dense_w, packed_w)]
    linear = F.linear
    pointwise = torch.ops.mkldnn._linear_pointwise

    def run_dense() -> None:
        for x, w in dense_args:
            linear(x, w)

    def run_packed() -> None:
        for x, w in packed_args:
            pointwise(x, w, None, "none", [], "")

    t_dense, best_dense = time_loop(run_dense, min_s, 5)
    t_packed, best_packed = time_loop(run_packed, min_s, 5)
    flops = 2 * batch * sum(w.shape[0] * w.shape[1] for w in dense_w)
    t = min(t_dense, t_packed)
    return {
        "batch": batch,
        "dense_ms": t_dense * 1e3,
        "packed_ms": t_packed * 1e3,
        "ceiling_tok_s": batch / t,
        "ceiling_tok_s_best": batch / min(best_dense, best_packed),
        "gflop_s": flops / t / 1e9,
        "weight_gb_s": sum(w.numel() * w.element_size() for w in dense_w) / t / 1e9,
    }


# ------------------------------------------------------------ engine decode


class DecodeHarness:
    """``batch`` requests admitted at once, stepped past their prefill into steady decode."""

    def __init__(self, loaded: Any, batch: int, context: int, decode_steps: int, seed: int) -> None:
        from streamkv.sampling_params import SamplingParams

        vocab = loaded.model.config.vocab_size
        budget = max(2048, batch)
        # sequences prefilled first decode while the rest prefill: give them room for those steps too
        max_new = decode_steps + -(-batch * context // budget) + 4
        blocks = batch * -(-(context + max_new + 1) // 16) + 16
        self.llm = make_llm(loaded, max_num_seqs=max(batch, 1), max_num_batched_tokens=budget, num_blocks=blocks)
        self.core = self.llm.core
        self.batch = batch
        params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
        for i, prompt in enumerate(make_prompts([context] * batch, seed, vocab)):
            self.core.add_request(f"limit-{batch}-{i}", prompt, params, lambda out: None)
        self.shapes: list[tuple[int, int]] = []
        original = self.core.runner.execute

        def execute(out: Any) -> Any:
            self.shapes.append((out.num_batched_tokens, len(out.scheduled)))
            return original(out)

        self.core.runner.execute = execute
        # prefill, until one step decodes every sequence
        while True:
            self.core.step()
            if self.shapes[-1] == (batch, batch):
                break

    def context_len(self) -> int:
        return max(s.num_tokens for s in self.core.scheduler.running)

    def step(self) -> float:
        t = time.perf_counter()
        self.core.step()
        dt = time.perf_counter() - t
        assert self.shapes[-1] == (self.batch, self.batch), f"not a pure decode step: {self.shapes[-1]}"
        return dt


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


# --------------------------------------------------------------- breakdown


class Timers:
    """Accumulated seconds and call counts per label."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        seconds, calls, clock = self.seconds, self.calls, time.perf_counter

        def timed(*a: Any, **k: Any) -> Any:
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                seconds[label] += clock() - t
                calls[label] += 1

        return timed


@contextmanager
def patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set ``obj.name = value`` for each triple; restore (or delete instance attributes) afterwards."""
    saved = []
    for obj, name, value in patches:
        had = name in getattr(obj, "__dict__", {})
        saved.append((obj, name, obj.__dict__[name] if had else None, had))
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, old, had in reversed(saved):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)


def instrument(h: DecodeHarness, timers: Timers) -> list[tuple[Any, str, Any]]:
    """Wrappers on every stage of one engine step (instance attributes, module globals, one classmethod)."""
    import streamkv.attention.torch_paged as torch_paged
    import streamkv.engine_core as engine_core
    import streamkv.model.llama as llama
    from streamkv.attention.metadata import AttentionMetadata
    from streamkv.detokenizer import IncrementalDetokenizer

    core, runner, model = h.core, h.core.runner, h.core.runner.model
    w = timers.wrap
    build = AttentionMetadata.__dict__["build"].__func__
    add_token = IncrementalDetokenizer.add_token
    p: list[tuple[Any, str, Any]] = [
        (core.scheduler, "schedule", w("scheduler.schedule", core.scheduler.schedule)),
        (core.scheduler, "update", w("scheduler.update", core.scheduler.update)),
        (runner, "execute", w("runner.execute (total)", runner.execute)),
        (AttentionMetadata, "build", classmethod(w("  AttentionMetadata.build", build))),
        (model, "forward", w("  model forward (total)", model.forward)),
        (model, "compute_logits", w("  compute_logits (LM head)", model.compute_logits)),
        (core.backend, "forward", w("    attention (total)", core.backend.forward)),
        (torch_paged, "_decode", w("      paged decode (gather+bmm)", torch_paged._decode)),
        (llama, "apply_rope", w("    rope", llama.apply_rope)),
        (engine_core, "sample_batch", w("sample_batch", engine_core.sample_batch)),
        (core, "_append_token", w("append_token (total)", core._append_token)),
        (IncrementalDetokenizer, "add_token", w("  detokenizer.add_token", add_token)),
        (core, "_emit", w("emit outputs", core._emit)),
    ]
    for name, module in model.named_modules():
        if isinstance(module, llama.Linear):
            p.append((module, "forward", w(f"      linear {name.rsplit('.', 1)[-1]}", module.forward)))
        elif isinstance(module, llama.RMSNorm):
            p.append((module, "forward", w("    rmsnorm", module.forward)))
        elif isinstance(module, llama.MLP):
            p.append((module, "forward", w("    mlp (total)", module.forward)))
    return p


def step_breakdown(loaded: Any, batch: int, context: int, steps: int, seed: int) -> dict:
    """Per-stage milliseconds of one decode step at ``batch`` (mean over ``steps`` instrumented steps)."""
    h = DecodeHarness(loaded, batch, context, 3 + 4 * steps, seed)  # warm, plain, instrumented, 2 profiles
    for _ in range(3):
        h.step()
    plain = [h.step() for _ in range(steps)]
    timers = Timers()
    with patched(instrument(h, timers)):
        instrumented = [h.step() for _ in range(steps)]
    ms = {k: v / steps * 1e3 for k, v in timers.seconds.items()}
    step_ms = statistics.fmean(instrumented) * 1e3
    # derived rows: what the wrappers leave between them
    lin = sum(v for k, v in ms.items() if k.startswith("      linear "))
    ms["    linear (all projections)"] = lin
    mlp_total = ms.pop("    mlp (total)", 0.0)
    mlp_lin = ms.get("      linear gate_up_proj", 0.0) + ms.get("      linear down_proj", 0.0)
    ms["    activation (silu*up, split)"] = max(0.0, mlp_total - mlp_lin)
    attn = ms.get("    attention (total)", 0.0)
    decode = ms.get("      paged decode (gather+bmm)", 0.0)
    ms["      KV write (index_copy_ x2)"] = max(0.0, attn - decode)
    fwd = ms.get("  model forward (total)", 0.0)
    accounted = lin + attn + ms.get("    rmsnorm", 0.0) + ms.get("    rope", 0.0) + ms["    activation (silu*up, split)"]
    ms["    rest of forward (embedding, residual adds, views, rope index)"] = max(0.0, fwd - accounted)
    ex = ms.get("runner.execute (total)", 0.0)
    ms["  input tensors, row gather"] = max(
        0.0, ex - ms.get("  AttentionMetadata.build", 0.0) - fwd - ms.get("  compute_logits (LM head)", 0.0)
    )
    app = ms.get("append_token (total)", 0.0)
    ms["  rest of append_token (bookkeeping)"] = max(0.0, app - ms.get("  detokenizer.add_token", 0.0))
    top = ["scheduler.schedule", "runner.execute (total)", "scheduler.update", "sample_batch",
           "append_token (total)", "emit outputs"]  # fmt: skip
    ms["step loop rest (deltas dict, row list, counters)"] = max(0.0, step_ms - sum(ms.get(k, 0.0) for k in top))
    return {
        "batch": batch,
        "context": h.context_len(),
        "step_ms_plain": statistics.fmean(plain) * 1e3,
        "step_ms_instrumented": step_ms,
        "calls_per_step": {k: v / steps for k, v in timers.calls.items()},
        "ms": ms,
        "harness": h,
    }


ORDER = [
    "scheduler.schedule",
    "runner.execute (total)",
    "  AttentionMetadata.build",
    "  input tensors, row gather",
    "  model forward (total)",
    "    linear (all projections)",
    "      linear qkv_proj",
    "      linear o_proj",
    "      linear gate_up_proj",
    "      linear down_proj",
    "    attention (total)",
    "      KV write (index_copy_ x2)",
    "      paged decode (gather+bmm)",
    "    rmsnorm",
    "    rope",
    "    activation (silu*up, split)",
    "    rest of forward (embedding, residual adds, views, rope index)",
    "  compute_logits (LM head)",
    "scheduler.update",
    "sample_batch",
    "append_token (total)",
    "  detokenizer.add_token",
    "  rest of append_token (bookkeeping)",
    "emit outputs",
    "step loop rest (deltas dict, row list, counters)",
]


def print_breakdown(bd: dict) -> None:
    step = bd["step_ms_instrumented"]
    matmul = bd["ms"].get("    linear (all projections)", 0.0) + bd["ms"].get("  compute_logits (LM head)", 0.0)
    print(
        f"--- one decode step at batch {bd['batch']} (context ~{bd['context']}): "
        f"{bd['step_ms_plain']:.2f} ms plain, {step:.2f} ms instrumented (wrapper overhead included)"
    )
    print(f"  {'stage':66s} {'ms/step':>8s} {'share':>6s} {'calls':>6s}")
    for k in ORDER:
        if k not in bd["ms"]:
            continue
        v = bd["ms"][k]
        calls = bd["calls_per_step"].get(k)
        c = f"{calls:6.0f}" if calls is not None else "     -"
        print(f"  {k:66s} {v:8.2f} {v / step:6.1%} {c}")
    print(
        f"  matmuls (projections + LM head) inside the step: {matmul:.2f} ms = {matmul / step:.1%} of it; "
        f"a step that ran only its matmuls would decode {bd['batch'] / matmul * 1e3:.0f} tok/s "
        f"(same-run cross-check of the ceiling, robust to contention between timing windows)"
    )


@torch.inference_mode()
def attention_stages(h: DecodeHarness, reps: int) -> dict[str, float]:
    """One layer's decode attention split into stages, on the harness's live cache and block tables.

    A stage-by-stage replica of ``streamkv.attention.torch_paged._decode`` (and
    the KV write before it) at this commit; milliseconds per layer call.
    """
    from streamkv.attention.metadata import AttentionMetadata
    from streamkv.attention.torch_paged import _slots

    core = h.core
    running = core.scheduler.running
    bs = core.block_size
    # the context already in the pool (the block tables cover it; the next token may need a new block)
    meta = AttentionMetadata.build(
        query_lens=[1] * len(running),
        seq_lens=[s.num_computed_tokens for s in running],
        block_tables=[core.kv.block_table(s.seq_id) for s in running],
        block_size=bs,
    )
    m = core.runner.model
    hq, hkv, d = m.config.num_attention_heads, m.num_kv_heads, m.head_dim
    b = len(running)
    kv_cache = core.runner.kv_caches[0]
    flat = kv_cache.view(2, -1, hkv, d)
    q = torch.randn(b, hq, d)
    k_new, v_new = torch.randn(b, hkv, d), torch.randn(b, hkv, d)
    scale = d**-0.5
    out: dict[str, float] = {}

    def t(label: str, fn: Callable[[], Any]) -> Any:
        res = fn()
        times = []
        for _ in range(reps):
            s = time.perf_counter()
            res = fn()
            times.append(time.perf_counter() - s)
        out[label] = statistics.median(times) * 1e3
        return res

    slots_new = meta.slot_mapping.clone()
    t("KV write (2x index_copy_)", lambda: (flat[0].index_copy_(0, slots_new, k_new), flat[1].index_copy_(0, slots_new, v_new)))  # noqa: E501

    def masks() -> tuple[torch.Tensor, ...]:
        ctx = torch.arange(meta.max_seq_len)
        valid = ctx < meta.seq_lens[:, None]
        pos = torch.where(valid, ctx, 0)
        slots = _slots(meta.block_tables, pos, bs)
        rows = slots[:, None, :] * hkv + torch.arange(hkv)[:, None]
        bias = torch.where(valid, 0.0, float("-inf")).to(q.dtype)
        bias = bias[:, None, None, :].expand(b, hkv, 1, meta.max_seq_len).reshape(-1, 1, meta.max_seq_len)
        return rows, bias

    rows, bias = t("mask, slots, bias (recomputed every layer)", masks)
    kv = t("gather K,V (index_select, copy)", lambda: flat.view(2, -1, d).index_select(1, rows.view(-1)))
    kv = kv.view(2, b * hkv, meta.max_seq_len, d)
    qg = q.reshape(b * hkv, hq // hkv, d)
    scores = t("q K^T (baddbmm)", lambda: torch.baddbmm(bias, qg, kv[0].transpose(1, 2), alpha=scale))
    probs = t("softmax", lambda: scores.softmax(-1, dtype=torch.float32))
    t("probs V (bmm)", lambda: torch.bmm(probs, kv[1]))
    out["gathered bytes per layer (MB)"] = kv.numel() * kv.element_size() / 1e6
    return out


def torch_profile(h: DecodeHarness, steps: int, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            h.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def python_profile(h: DecodeHarness, steps: int, top: int) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        h.step()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    text = s.getvalue()
    return text[text.find("   ncalls") :] if "   ncalls" in text else text


# --------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default=None, help="comma-separated decode batches (default 1,32,128; quick 1,8)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens per sequence (default 128; quick 32)")
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (default 32; quick 6)")
    p.add_argument("--breakdown-batch", type=int, default=None, help="batch of the step breakdown (default 32; quick 8)")
    p.add_argument("--breakdown-steps", type=int, default=None, help="instrumented steps (default 10; quick 3)")
    p.add_argument("--min-seconds", type=float, default=None, help="timing window per ceiling (default 2; quick 0.3)")
    p.add_argument("--no-profile", action="store_true", help="skip torch.profiler and cProfile tables")
    p.add_argument("--quick", action="store_true", help="smoke sizes")
    p.add_argument("--threads", type=int, default=2)
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

    info = machine_banner(args.threads, "physical limit: linear layers alone vs engine decode")
    models = load_models(want_dense=True)
    print(f"model: {models.gguf_path} (fp32), loaded in {models.load_s:.1f} s\n", flush=True)
    dense_w, packed_w = linear_weights(models.dense.model, models.loaded.model)
    n_params = sum(w.numel() for w in dense_w)
    print(
        f"one decode step's matmuls: {len(dense_w)} weights ({len(dense_w) - 1} projections + LM head), "
        f"{n_params / 1e6:.1f} M parameters, {n_params * 4 / 1e6:.0f} MB fp32, {2 * n_params / 1e6:.0f} MFLOP/token\n"
    )
    rows = []
    print(f"{'batch':>5s} {'F.linear ms':>12s} {'packed ms':>10s} {'ceiling tok/s':>14s} {'GFLOP/s':>8s} "
          f"{'weights GB/s':>12s} | {'engine tok/s':>12s} {'median step ms':>14s} {'context':>9s} {'of ceiling':>10s}")  # fmt: skip
    for b in batches:
        c = linear_ceiling(dense_w, packed_w, b, min_s)
        e = engine_decode(models.loaded, b, context, args.warmup_steps, decode_steps, args.seed)
        # median step against the median ceiling loop: like for like, and robust to a stalled step
        frac = e["decode_tok_s_median_step"] / c["ceiling_tok_s"]
        frac_best = e["decode_tok_s_best_step"] / c["ceiling_tok_s_best"]
        rows.append({**c, **{f"engine_{k}": v for k, v in e.items()}, "fraction": frac, "fraction_best": frac_best})
        print(
            f"{b:5d} {c['dense_ms']:12.2f} {c['packed_ms']:10.2f} {c['ceiling_tok_s']:14.1f} {c['gflop_s']:8.1f} "
            f"{c['weight_gb_s']:12.1f} | {e['decode_tok_s']:12.1f} {e['step_ms_median']:14.2f} {e['context']:>9s} "
            f"{frac:10.1%}  (best vs best: {e['decode_tok_s_best_step']:.0f} of {c['ceiling_tok_s_best']:.0f} tok/s"
            f" = {frac_best:.0%})",
            flush=True,
        )
    print("(engine tok/s: all timed steps; the fraction: median step vs median ceiling loop; best vs best:\n"
          " fastest step vs fastest loop, the steadier figure when other work shares the CPU)\n")  # fmt: skip
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
