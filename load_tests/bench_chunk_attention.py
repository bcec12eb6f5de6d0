"""Prefill / chunk attention over cached context: the torch path (gather + SDPA) against the C++ in-place op.

Two parts, each with its variants interleaved (A/B/A/B...) in one process,
medians printed, so machine load hits both alike:

1. **One layer** (``--shapes``): SmolLM2-135M's attention shapes (9 query
   heads on 3 KV heads, head_dim 64, 16-token blocks shuffled across the
   pool). A shape ``NxQ+C`` is N sequences of Q new tokens over C cached
   ones. ``forward`` is timed whole (the KV write included, the same in both);
   GFLOP/s counts ``4 * Hq * D`` per (query row, visible key).
2. **An engine step** (``--engine``, the real SmolLM2-135M): ten sequences with
   656 cached tokens each get 44 new ones (one 440-token step, prefix hits),
   the chained-turn step of issue #12; and 4 x 512-token prompts with no
   cached context. Step wall time, and the time inside the attention
   backend's ``forward`` summed over layers.

    .venv/bin/python -m load_tests.bench_chunk_attention
    .venv/bin/python -m load_tests.bench_chunk_attention --engine --dtypes float32,bfloat16 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from streamkv.attention.backend import AttentionBackend  # noqa: E402
from streamkv.attention.metadata import AttentionMetadata  # noqa: E402
from streamkv.attention.torch_paged import TorchPagedAttention  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 16


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"10x44+656"`` -> (10 sequences, 44 new tokens, 656 cached)."""
    n, rest = text.split("x")
    q, c = rest.split("+")
    return int(n), int(q), int(c)


def make_step(num_seqs: int, q_len: int, cached: int, dtype: torch.dtype, seed: int = 0) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(seed)
    seq_len = cached + q_len
    per_seq = -(-seq_len // BS)
    num_blocks = num_seqs * per_seq + 8
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(num_seqs)]
    kv = torch.randn(2, num_blocks, BS, HKV, D, generator=gen).to(dtype)
    meta = AttentionMetadata.build([q_len] * num_seqs, [seq_len] * num_seqs, tables, BS)
    t = num_seqs * q_len
    q = torch.randn(t, HQ, D, generator=gen).to(dtype)
    k = torch.randn(t, HKV, D, generator=gen).to(dtype)
    v = torch.randn(t, HKV, D, generator=gen).to(dtype)
    return q, k, v, kv, meta


def layer_flops(num_seqs: int, q_len: int, cached: int) -> float:
    """Multiply-adds x 2 of QK^T and PV over the causally visible keys."""
    visible = sum(cached + r + 1 for r in range(q_len))
    return 4.0 * HQ * D * visible * num_seqs


def time_forward(backend: AttentionBackend, step: tuple[Any, ...], reps: int) -> tuple[float, float]:
    """Median wall ms and median process CPU ms (all threads) of one layer's ``forward``.

    On a loaded machine the CPU time is the steadier figure of the work done.
    """
    q, k, v, kv, meta = step
    wall, cpu = [], []
    for _ in range(reps):
        meta.step_cache.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        backend.forward(q, k, v, kv, meta, D**-0.5)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def bench_layers(args: argparse.Namespace) -> None:
    from streamkv.attention.cpu_paged import CpuPagedAttention

    variants: dict[str, AttentionBackend] = {"torch": TorchPagedAttention(), "cpp": CpuPagedAttention()}
    print("| shape (N x new + cached) | dtype | torch ms/layer (CPU ms) | C++ ms/layer (CPU ms) | speed-up wall (CPU) "
          "| C++ GFLOP/s wall | max diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for text in args.shapes.split(","):
            n, q_len, cached = parse_shape(text)
            step = make_step(n, q_len, cached, dtype)
            q, k, v, kv, meta = step
            a = variants["torch"].forward(q, k, v, kv.clone(), meta, D**-0.5)
            b = variants["cpp"].forward(q, k, v, kv.clone(), meta, D**-0.5)
            err = (a.float() - b.float()).abs().max().item()
            res: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, backend in variants.items():
                    res[name].append(time_forward(backend, step, args.reps))
            t, c = (statistics.median(r[0] for r in res[k]) for k in ("torch", "cpp"))
            tc, cc = (statistics.median(r[1] for r in res[k]) for k in ("torch", "cpp"))
            gflops = layer_flops(n, q_len, cached) / (c * 1e-3) / 1e9
            print(f"| {text} | {dtype_name} | {t:.2f} ({tc:.2f}) | {c:.2f} ({cc:.2f}) | {t / c:.2f}x ({tc / cc:.2f}x) "
                  f"| {gflops:.0f} | {err:.1e} |")  # fmt: skip


def timed_forward(backend: AttentionBackend, acc: list[float]) -> Callable[..., torch.Tensor]:
    """``backend.forward`` wrapped to add its wall time to ``acc[0]``."""
    inner = backend.forward

    def forward(*a: Any, **kw: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        out = inner(*a, **kw)
        acc[0] += time.perf_counter() - t0
        return out

    return forward


def bench_engine(args: argparse.Namespace) -> None:
    from streamkv.llm import LLM
    from streamkv.sampling_params import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    print("| workload | dtype | backend | step s | attention s | attention share |")
    print("|---|---|---|---|---|---|")
    for dtype_name in args.dtypes.split(","):
        engines: dict[str, Any] = {}
        loaded = None
        for name in ("torch", "cpu"):
            llm = LLM(device="cpu", dtype=dtype_name, attention_backend=name, loaded=loaded, num_blocks=1200,
                      max_num_seqs=64, max_num_batched_tokens=512, enable_prefix_caching=True)  # fmt: skip
            loaded = llm.core.loaded
            engines[name] = llm.core
        gen = torch.Generator().manual_seed(0)
        contexts = [torch.randint(100, 40000, (656,), generator=gen).tolist() for _ in range(10)]
        for core in engines.values():  # warm: the contexts' blocks land in each prefix cache
            for i, ctx in enumerate(contexts):
                core.add_request(f"warm-{i}", ctx, one, lambda o: None)
            while core.has_work():
                core.step()
        acc = [0.0]
        for core in engines.values():
            core.backend.forward = timed_forward(core.backend, acc)  # type: ignore[method-assign]
        res: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for rnd in range(args.rounds):
            tails = [torch.randint(100, 40000, (44,), generator=gen).tolist() for _ in range(10)]
            fresh = [torch.randint(100, 40000, (512,), generator=gen).tolist() for _ in range(4)]
            workloads = {"10 x (656 cached + 44)": [c + t for c, t in zip(contexts, tails, strict=True)],
                         "4 x 512, no context": fresh}  # fmt: skip
            for workload, prompts in workloads.items():
                for name, core in engines.items():
                    for i, prompt in enumerate(prompts):
                        core.add_request(f"r{rnd}-{workload}-{i}", prompt, one, lambda o: None)
                    acc[0] = 0.0
                    t0 = time.perf_counter()
                    while core.has_work():
                        core.step()
                    res.setdefault((workload, name), []).append((time.perf_counter() - t0, acc[0]))
        for (workload, name), runs in res.items():
            step = statistics.median(r[0] for r in runs)
            attn = statistics.median(r[1] for r in runs)
            print(f"| {workload} | {dtype_name} | {name} | {step:.3f} | {attn:.3f} | {attn / step:.0%} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default="10x44+656,1x44+656,4x16+400,1x128+1024,4x512+0")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per variant")
    p.add_argument("--reps", type=int, default=5, help="calls per round (layer part)")
    p.add_argument("--engine", action="store_true", help="also time engine steps on the real SmolLM2-135M")
    p.add_argument("--no-layers", action="store_true", help="skip the one-layer part")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {os.getloadavg()[0]:.2f}")
    if not args.no_layers:
        bench_layers(args)
    if args.engine:
        bench_engine(args)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
