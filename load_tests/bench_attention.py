"""Paged decode attention of one layer: the torch reference against the C++ in-place op.

SmolLM2-135M's attention shapes (9 query heads on 3 KV heads, head_dim 64,
16-token blocks), a pool with block tables shuffled across it, one decode
token per sequence. Variants run interleaved (A/B/A/B...) in one process and
the median of each is printed, so machine load hits both alike.

    .venv/bin/python -m load_tests.bench_attention --threads 1
    .venv/bin/python -m load_tests.bench_attention --batches 32,64 --contexts 150,400 --dtypes float32,bfloat16

``--layers N`` times the C++ op alone over N distinct pools, one per layer as in
a decode step, so each call reads its KV from memory rather than from cache,
and prints the KV bytes read per second (the host reads ~42 GB/s with two
threads). ``--tables engine`` lays the block tables out as the engine's
allocator does for a batch admitted at once (each sequence's prompt blocks
together, then one block per sequence in turn as decode fills them):

    .venv/bin/python -m load_tests.bench_attention --threads 2 --layers 30 --tables engine \
        --batches 32,64 --contexts 192 --dtypes float32,bfloat16,int8

An int8 pool gets float32 queries unless ``--int8-query bfloat16`` (what a bf16 model's decode sends it).
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


def engine_tables(batch: int, per_seq: int, prompt_blocks: int) -> list[list[int]]:
    """Block ids as a fresh pool hands them out to ``batch`` sequences admitted at once: each one's
    ``prompt_blocks`` together, then the decode blocks one sequence after another."""
    tables: list[list[int]] = [[] for _ in range(batch)]
    nxt = 0
    for table in tables:
        table.extend(range(nxt, nxt + min(prompt_blocks, per_seq)))
        nxt += len(table)
    for _ in range(per_seq - min(prompt_blocks, per_seq)):
        for table in tables:
            table.append(nxt)
            nxt += 1
    return tables


def make_pool(num_blocks: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A random ``[2, num_blocks, BS, HKV, D]`` pool (``int8``: ``D + 4`` bytes a row, codes then a float32 scale)."""
    if dtype == torch.int8:
        kv = torch.randint(-127, 128, (2, num_blocks, BS, HKV, D + 4), generator=gen, dtype=torch.int8)
        kv[..., D:].view(torch.float32).fill_(0.01)
        return kv
    return torch.randn(2, num_blocks, BS, HKV, D, generator=gen).to(dtype)


def make_step(
    batch: int,
    context: int,
    dtype: torch.dtype,
    seed: int = 0,
    tables_order: str = "shuffled",
    int8_query: torch.dtype = torch.float32,
):
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BS)
    num_blocks = batch * per_seq + 8
    if tables_order == "engine":
        tables = engine_tables(batch, per_seq, prompt_blocks=8)
    else:
        order = torch.randperm(num_blocks, generator=gen).tolist()
        tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    kv = make_pool(num_blocks, dtype, gen)
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, BS)
    q = torch.randn(batch, HQ, D, generator=gen).to(int8_query if dtype == torch.int8 else dtype)
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
    p.add_argument("--layers", type=int, default=1, help="> 1: the C++ op alone over this many distinct pools")
    p.add_argument("--tables", choices=("shuffled", "engine"), default="shuffled", help="block table layout")
    p.add_argument("--int8-query", choices=("float32", "bfloat16"), default="float32",
                   help="the query dtype over an int8 pool (a bf16 model's decode runs bfloat16)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.layers > 1:
        return cold_layers(args)
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


def cold_layers(args: argparse.Namespace) -> int:
    """The C++ decode op over ``args.layers`` distinct pools per round: best and median ms, and KV GB/s."""
    from streamkv.ops.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None:
        print("the C++ CPU ops cannot be built here")
        return 1
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.layers} layers, {args.tables} tables, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| batch | context | KV dtype | best ms | median ms | KV read GB/s (best) |")
    print("|---|---|---|---|---|---|")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                steps = [make_step(batch, context, dtype, seed=i, tables_order=args.tables,
                                   int8_query=getattr(torch, args.int8_query)) for i in range(args.layers)]
                q, _, meta = steps[0]
                out = torch.empty_like(q)
                tables, lens = meta.block_tables.to(torch.int32), meta.seq_lens.to(torch.int32)
                times = []
                for _ in range(args.rounds * 2):
                    t0 = time.perf_counter()
                    for _, kv, _ in steps:
                        ops.paged_decode(out, q, kv, tables, lens, D**-0.5)
                    times.append(time.perf_counter() - t0)
                row_bytes = steps[0][1][0, 0, 0, 0].numel() * steps[0][1].element_size()
                gbs = args.layers * int(lens.sum()) * HKV * 2 * row_bytes / min(times) / 1e9
                print(f"| {batch} | {context} | {dtype_name} | {min(times) * 1e3:.2f} | "
                      f"{statistics.median(times) * 1e3:.2f} | {gbs:.1f} |")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
