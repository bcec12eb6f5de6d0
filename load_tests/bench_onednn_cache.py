"""What oneDNN's and ideep's shape caches cost and save, at SmolLM2-135M's linear shapes (issue #15 item 13).

Each new input shape of a oneDNN-prepacked linear (``rows`` = tokens in a
step) builds a primitive, kept in oneDNN's primitive cache
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's LRU cache
(``LRU_CACHE_CAPACITY``), 1024 entries each by default. Two questions,
each answered in a fresh subprocess:

- ``late``: do the env vars still take effect when set after ``import torch``
  but before the first matmul (as ``streamkv serve --onednn-cache-capacity``
  sets them when a wrapper such as ``load_tests.heap_probe`` imported torch
  first)? RSS growth over ``--rows`` row counts (5 shapes each, one layer's
  worth of calls), capacity 16 set late for both variables, for each alone,
  and unset.
- ``miss``: what a miss costs against a step's linears, one thread. Both
  capacities 1 (any other shape evicts); each of the 5 weight shapes is
  timed on ``n`` rows (the lm_head on ``min(n, 64)``) right after another
  row count evicted it (a miss) and again at once (a hit), medians of
  ``--reps``. Against it, one "step": the model's 30 layers' linears (qkv,
  o, gate_up, down) and the lm_head; attention and the rest of the step are
  not included, so the share of a real step is smaller still. On a loaded
  machine the larger sizes' miss cost is within the noise of the matmul.

    python -m load_tests.bench_onednn_cache
    python -m load_tests.bench_onednn_cache --rows 50 --sizes 1,4,16,64,256,512   # the run in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import orjson

HIDDEN, QKV, INTER, VOCAB, LAYERS = 576, 960, 1536, 49152, 30  # SmolLM2-135M
ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def _rss_mb() -> float:
    from load_tests.heap_probe import rss_anon_plus_swap

    return rss_anon_plus_swap() / (1 << 20)


def _weights() -> dict[str, object]:
    import torch

    torch.manual_seed(0)
    shapes = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER),
              "lm_head": (VOCAB, HIDDEN)}  # fmt: skip
    return {k: torch.ops.mkldnn._reorder_linear_weight(torch.randn(s) * 0.02, 64) for k, s in shapes.items()}


def _step(w: dict[str, object], n: int, layers: int = LAYERS) -> None:
    import torch

    lin = torch.ops.mkldnn._linear_pointwise
    x, xi = torch.randn(n, HIDDEN), torch.randn(n, INTER)
    for _ in range(layers):
        lin(x, w["qkv"], None, "none", [], "")
        lin(x, w["o"], None, "none", [], "")
        lin(x, w["gate_up"], None, "none", [], "")
        lin(xi, w["down"], None, "none", [], "")
    lin(x[: min(n, 64)], w["lm_head"], None, "none", [], "")


def child_late(capacity: int | None, rows: int, names: tuple[str, ...] = ENV) -> dict[str, object]:
    import torch

    torch.set_num_threads(1)
    if capacity is not None:  # after import torch, before the first oneDNN primitive
        for name in names:
            os.environ[name] = str(capacity)
    w = _weights()
    _step(w, 1, layers=1)
    base = _rss_mb()
    for n in range(2, rows + 1):
        _step(w, n, layers=1)  # the shapes of every layer; one layer's worth of time
    return {"capacity": capacity, "set": list(names), "rows": rows, "shapes": 5 * rows,
            "rss_growth_mb": round(_rss_mb() - base, 1)}  # fmt: skip


def child_miss(sizes: list[int], reps: int) -> dict[str, object]:
    for name in ENV:
        os.environ[name] = "1"  # before import torch: any other shape evicts the last one
    import torch

    torch.set_num_threads(1)
    lin = torch.ops.mkldnn._linear_pointwise
    w = _weights()
    out: dict[str, object] = {"threads": 1}
    for n in sizes:
        per_shape: dict[str, float] = {}
        for name, weight in w.items():
            x = torch.randn(n if name != "lm_head" else min(n, 64), INTER if name == "down" else HIDDEN)
            other = torch.randn(x.shape[0] + 1, x.shape[1])
            miss, hit = [], []
            for _ in range(reps):
                lin(other, weight, None, "none", [], "")  # evicts x's primitive
                t = time.perf_counter()
                lin(x, weight, None, "none", [], "")
                miss.append(time.perf_counter() - t)
                t = time.perf_counter()
                lin(x, weight, None, "none", [], "")
                hit.append(time.perf_counter() - t)
            per_shape[name] = (sorted(miss)[reps // 2] - sorted(hit)[reps // 2]) * 1e3
        steps = []
        for _ in range(3):
            t = time.perf_counter()
            _step_hits(w, n)
            steps.append(time.perf_counter() - t)
        step_ms = sorted(steps)[1] * 1e3
        total = sum(per_shape.values())
        out[str(n)] = {"miss_cost_ms": {k: round(v, 3) for k, v in per_shape.items()},
                       "five_misses_ms": round(total, 2), "linears_of_a_step_ms": round(step_ms, 1),
                       "miss_share_of_step": round(total / step_ms, 3)}  # fmt: skip
    return out


def _step_hits(w: dict[str, object], n: int) -> None:
    """A step's linears, each weight's layers run back to back (capacity 1 still hits within a weight)."""
    import torch

    lin = torch.ops.mkldnn._linear_pointwise
    x, xi = torch.randn(n, HIDDEN), torch.randn(n, INTER)
    for name in ("qkv", "o", "gate_up"):
        for _ in range(LAYERS):
            lin(x, w[name], None, "none", [], "")
    for _ in range(LAYERS):
        lin(xi, w["down"], None, "none", [], "")
    lin(x[: min(n, 64)], w["lm_head"], None, "none", [], "")


def _run(*argv: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    done = subprocess.run([sys.executable, "-m", "load_tests.bench_onednn_cache", *argv], env=env,
                          capture_output=True, text=True, check=True, timeout=900)  # fmt: skip
    return dict(orjson.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=50, help="row counts for the late-env check")
    parser.add_argument("--sizes", default="1,4,16,64,256,512", help="step rows for the miss cost")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--child", choices=("late", "miss"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--env", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child == "late":
        names = tuple(args.env.split(",")) if args.env else ENV
        print(orjson.dumps(child_late(args.capacity, args.rows, names)).decode())
        return 0
    if args.child == "miss":
        print(orjson.dumps(child_miss(sizes, args.reps)).decode())
        return 0
    result = {
        "late_unset": _run("--child", "late", "--rows", str(args.rows)),
        "late_set_16": _run("--child", "late", "--rows", str(args.rows), "--capacity", "16"),
        **{f"late_set_16_{name}": _run("--child", "late", "--rows", str(args.rows), "--capacity", "16", "--env", name)
           for name in ENV},
        "miss": _run("--child", "miss", "--sizes", args.sizes, "--reps", str(args.reps)),
    }  # fmt: skip
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
