"""Where one engine decode step's time goes: the stages of ``EngineCore.step``, timed in place.

:class:`DecodeHarness` admits ``batch`` requests at once and steps them past
their prefill into steady decode. :func:`step_breakdown` wraps every stage of
one step on that instance (scheduler.schedule, AttentionMetadata.build, the
rest of the runner's input build, the forward split into linear / attention
/ norms / RoPE / activation / the rest, compute_logits, sampling,
scheduler.update, token append with detokenization, output emission);
:func:`attention_stages` replays one layer's decode attention stage by stage;
:func:`torch_profile` and :func:`python_profile` give torch.profiler's top ops
and cProfile's top functions. Nothing in ``streamkv`` is edited; wrappers are
removed afterwards. Used by ``bench_limit``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from load_tests.bench_common_throughput import make_llm, make_prompts

# ----------------------------------------------------------- decode harness


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
        original = self.core.runner.forward

        def forward(out: Any) -> Any:
            self.shapes.append((out.num_batched_tokens, len(out.scheduled)))
            return original(out)

        self.core.runner.forward = forward
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
    from streamkv.model.swiglu import GateUpSiluMul

    core, runner, model = h.core, h.core.runner, h.core.runner.model
    w = timers.wrap
    build = AttentionMetadata.__dict__["build"].__func__
    add_token = IncrementalDetokenizer.add_token
    p: list[tuple[Any, str, Any]] = [
        (core.scheduler, "schedule", w("scheduler.schedule", core.scheduler.schedule)),
        (core.scheduler, "update", w("scheduler.update", core.scheduler.update)),
        (runner, "forward", w("runner (forward and LM head)", runner.forward)),
        (runner, "logits", w("runner (forward and LM head)", runner.logits)),
        (runner, "greedy_tokens", w("runner (forward and LM head)", runner.greedy_tokens)),
        (AttentionMetadata, "build", classmethod(w("  AttentionMetadata.build", build))),
        (model, "forward", w("  model forward (total)", model.forward)),
        (model, "compute_logits", w("  compute_logits (LM head)", model.compute_logits)),
        (model, "greedy_tokens", w("  greedy head (LM head, greedy steps)", model.greedy_tokens)),
        (core.backend, "forward", w("    attention (total)", core.backend.forward)),
        (torch_paged, "_decode", w("      paged decode (gather+bmm)", torch_paged._decode)),
        (llama, "apply_rope", w("    rope", llama.apply_rope)),  # the torch ops' RoPE; the fused op is in "rest"
        (engine_core, "sample_batch", w("sample_batch", engine_core.sample_batch)),
        (core.outputs, "_append_token", w("append_token (total)", core.outputs._append_token)),
        (IncrementalDetokenizer, "add_token", w("  detokenizer.add_token", add_token)),
        (core.outputs, "_emit", w("emit outputs", core.outputs._emit)),
    ]
    if type(core.backend).decode is not torch_paged.TorchPagedAttention.decode:  # the C++ cpu backend's own op
        p.append((core.backend, "decode", w("      paged decode (C++ op)", core.backend.decode)))
    for name, module in model.named_modules():
        if isinstance(module, llama.Linear):
            p.append((module, "forward", w(f"      linear {name.rsplit('.', 1)[-1]}", module.forward)))
        elif isinstance(module, llama.RMSNorm):
            # every norm runs through add_forward (the residual add fused in); it calls forward on the torch path
            p.append((module, "add_forward", w("    rmsnorm", module.add_forward)))
        elif isinstance(module, llama.MLP):
            p.append((module, "forward", w("    mlp (total)", module.forward)))
    # a bf16 model on AMX runs gate_up with SiLU-and-mul in one op (streamkv/model/swiglu.py), not gate_up_proj
    p.append((GateUpSiluMul, "__call__", w("      linear gate_up_proj + SiLU-and-mul", GateUpSiluMul.__call__)))
    return p


def step_breakdown(loaded: Any, batch: int, context: int, steps: int, seed: int) -> dict:
    """Per-stage milliseconds of one decode step at ``batch`` (mean over ``steps`` instrumented steps)."""
    h = DecodeHarness(loaded, batch, context, 3 + 4 * steps, seed)  # warm, plain, instrumented, 2 profiles
    for _ in range(3):
        h.step()
    plain = [h.step() for _ in range(steps)]
    timers = Timers()
    patches = instrument(h, timers)
    # The decode_layer op runs each layer in one C++ call that no wrapper can split: the instrumented steps run
    # the layer-by-layer path it replaces (the same kernels), and the report says so.
    decoder = h.core.runner.model.model
    op_in_use = getattr(decoder, "decode_layers", None) is not None
    if op_in_use:
        patches.append((decoder, "decode_layers", None))
    with patched(patches):
        instrumented = [h.step() for _ in range(steps)]
    ms = {k: v / steps * 1e3 for k, v in timers.seconds.items()}
    step_ms = statistics.fmean(instrumented) * 1e3
    # derived rows: what the wrappers leave between them
    lin = sum(v for k, v in ms.items() if k.startswith("      linear "))
    ms["    linear (all projections)"] = lin
    mlp_total = ms.pop("    mlp (total)", 0.0)
    mlp_lin = sum(ms.get(f"      linear {name}", 0.0) for name in ("gate_up_proj", "down_proj"))
    mlp_lin += ms.get("      linear gate_up_proj + SiLU-and-mul", 0.0)
    ms["    activation (silu*up, split)"] = max(0.0, mlp_total - mlp_lin)
    attn = ms.get("    attention (total)", 0.0)
    decode = ms.get("      paged decode (gather+bmm)", 0.0) + ms.get("      paged decode (C++ op)", 0.0)
    ms["      KV write + rest of attention"] = max(0.0, attn - decode)
    fwd = ms.get("  model forward (total)", 0.0)
    accounted = (
        lin + attn + ms.get("    rmsnorm", 0.0) + ms.get("    rope", 0.0) + ms["    activation (silu*up, split)"]
    )
    ms["    rest of forward (embedding, views, rope index; fused RoPE)"] = max(0.0, fwd - accounted)
    ex = ms.get("runner (forward and LM head)", 0.0)
    ms["  input tensors, row gather"] = max(0.0, ex - ms.get("  AttentionMetadata.build", 0.0) - fwd - lm_head(ms))
    app = ms.get("append_token (total)", 0.0)
    ms["  rest of append_token (bookkeeping)"] = max(0.0, app - ms.get("  detokenizer.add_token", 0.0))
    top = ["scheduler.schedule", "runner (forward and LM head)", "scheduler.update", "sample_batch",
           "append_token (total)", "emit outputs"]  # fmt: skip
    ms["step loop rest (deltas dict, row list, counters)"] = max(0.0, step_ms - sum(ms.get(k, 0.0) for k in top))
    return {
        "batch": batch,
        "context": h.context_len(),
        "step_ms_plain": statistics.fmean(plain) * 1e3,
        "decode_layer_op": op_in_use,
        "step_ms_instrumented": step_ms,
        "calls_per_step": {k: v / steps for k, v in timers.calls.items()},
        "ms": ms,
        "harness": h,
    }


def lm_head(ms: dict[str, float]) -> float:
    """ms of the step's LM head: the logits, or a greedy step's greedy head (``GreedyHead``)."""
    return ms.get("  compute_logits (LM head)", 0.0) + ms.get("  greedy head (LM head, greedy steps)", 0.0)


ORDER = [
    "scheduler.schedule",
    "runner (forward and LM head)",
    "  AttentionMetadata.build",
    "  input tensors, row gather",
    "  model forward (total)",
    "    linear (all projections)",
    "      linear qkv_proj",
    "      linear o_proj",
    "      linear gate_up_proj",
    "      linear down_proj",
    "    attention (total)",
    "      KV write + rest of attention",
    "      paged decode (gather+bmm)",
    "      paged decode (C++ op)",
    "    rmsnorm",
    "    rope",
    "    activation (silu*up, split)",
    "    rest of forward (embedding, views, rope index; fused RoPE)",
    "  compute_logits (LM head)",
    "  greedy head (LM head, greedy steps)",
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
    matmul = bd["ms"].get("    linear (all projections)", 0.0) + lm_head(bd["ms"])
    print(
        f"--- one decode step at batch {bd['batch']} (context ~{bd['context']}): "
        f"{bd['step_ms_plain']:.2f} ms plain, {step:.2f} ms instrumented (wrapper overhead included)"
    )
    if bd.get("decode_layer_op"):
        print(
            "  (the plain steps ran each layer in one decode_layer call; the instrumented steps below run the\n"
            "   layer-by-layer path it replaces, the same kernels, so their extra time is that path's Python)"
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
    if kv_cache.dtype != torch.float32:
        return {}  # the replica is the fp32 torch path
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
