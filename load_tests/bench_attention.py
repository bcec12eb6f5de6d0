"""Paged decode attention of one layer: the torch reference against the C++ in-place op.

SmolLM2-135M's attention shapes (9 query heads on 3 KV heads, head_dim 64,
16-token blocks), a pool with block tables shuffled across it, one decode
token per sequence. Variants run interleaved (A/B/A/B...) in one process and
the median of each is printed, so machine load hits both alike.

    .venv/bin/python -m load_tests.bench_attention --threads 1
    .venv/bin/python -m load_tests.bench_attention --batches 32,64 --contexts 150,400 --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from streamkv.attention.metadata import AttentionMetadata  # noqa: E402
from streamkv.attention.torch_paged import TorchPagedAttention  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 16


def make_step(batch: int, context: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BS)
    num_blocks = batch * per_seq + 8
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    kv = torch.randn(2, num_blocks, BS, HKV, D, generator=gen).to(dtype)
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, BS)
    q = torch.randn(batch, HQ, D, generator=gen).to(dtype)
    return q, kv, meta


def time_decode(backend, q, kv, meta, reps: int) -> float:
    """Median ms of ``backend.decode`` (the attention read, the KV write excluded)."""
    times = []
    for _ in range(reps):
        meta.step_cache.clear()  # the torch path builds its gather rows once per step, as in the engine
        t0 = time.perf_counter()
        backend.decode(q, kv, meta.block_tables, meta.seq_lens, meta.max_seq_len, meta, D**-0.5, "decode")
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", default="1,32,64")
    p.add_argument("--contexts", default="150,400")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per variant")
    p.add_argument("--reps", type=int, default=10, help="calls per round")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from streamkv.attention.cpu_paged import CpuPagedAttention

    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {os.getloadavg()[0]:.1f}")
    print("| batch | context | KV dtype | torch ms/layer | C++ ms/layer | speed-up |")
    print("|---|---|---|---|---|---|")
    variants = {"torch": TorchPagedAttention(), "cpp": CpuPagedAttention()}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                q, kv, meta = make_step(batch, context, dtype)
                a = variants["torch"].decode(q, kv, meta.block_tables, meta.seq_lens, context, meta, D**-0.5, "x")
                b = variants["cpp"].decode(q, kv, meta.block_tables, meta.seq_lens, context, meta, D**-0.5, "x")
                err = (a.float() - b.float()).abs().max().item()
                res: dict[str, list[float]] = {k: [] for k in variants}
                for _ in range(args.rounds):
                    for name, backend in variants.items():
                        res[name].append(time_decode(backend, q, kv, meta, args.reps))
                t, c = statistics.median(res["torch"]), statistics.median(res["cpp"])
                print(f"| {batch} | {context} | {dtype_name} | {t:.3f} | {c:.3f} | {t / c:.2f}x (max diff {err:.1e}) |")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
