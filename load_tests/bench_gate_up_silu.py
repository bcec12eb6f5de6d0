"""A bf16 decode step's gate_up and SiLU-and-mul: two ops (the small-batch kernel, then ``silu_and_mul``) or one.

SmolLM2's 30 gate_up weights (3,072 x 576) as random GGUF Q4_1 codes, each
its own (two packs of 30 x 1.05 MiB, read in turn, as a decode step reads
its layers'). For each row count M the two routings take turns ``--rounds``
times and the median of each is printed: the ops as ``decode_layer`` calls
them, ``small_linear`` into a ``[M, 3072]`` buffer then ``silu_and_mul``
(what a decode step ran before round 41), against ``small_linear_silu_mul``
on the interleaved pack (``streamkv/model/swiglu.py``), which writes ``act
[M, 1536]`` straight from the AMX kernel; no Python between them beyond the
call. Every weight's two results are then compared bit for bit. Needs
AMX-BF16 (the fused op runs only there).

    .venv/bin/python -m load_tests.bench_gate_up_silu
    .venv/bin/python -m load_tests.bench_gate_up_silu --rows 1,8,32,64 --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from load_tests.bench_small_linear import LAYERS, SHAPES, random_gguf  # noqa: E402
from load_tests.common import print_header  # noqa: E402
from streamkv.model.linear import SmallMatmul  # noqa: E402
from streamkv.model.swiglu import GateUpSiluMul  # noqa: E402
from streamkv.ops.cpu_ops import load_fused_ops, load_linear_ops  # noqa: E402


def time_rows(
    ops: ModuleType,
    fused: ModuleType,
    plain: list[SmallMatmul],
    interleaved: list[GateUpSiluMul],
    rows: int,
    k: int,
    rounds: int,
) -> tuple[tuple[float, float], bool]:
    """Median ms of (unfused, fused) over every weight at ``rows`` rows, and whether every weight's acts are equal."""
    x = torch.randn(rows, k).bfloat16()
    gate_up = x.new_empty(rows, 2 * interleaved[0].intermediate)
    act_unfused = x.new_empty(rows, interleaved[0].intermediate)
    act_fused = x.new_empty(rows, interleaved[0].intermediate)

    def unfused() -> None:
        for m in plain:
            ops.small_linear(gate_up, x, m.packed, None)
            fused.silu_and_mul(act_unfused, gate_up)

    def one_op() -> None:
        for f in interleaved:
            ops.small_linear_silu_mul(act_fused, x, f.packed, None)

    times: dict[str, list[float]] = {"unfused": [], "fused": []}
    unfused()
    one_op()
    for _ in range(rounds):  # taking turns, so load drifts hit both alike
        for name, fn in (("unfused", unfused), ("fused", one_op)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    same = True
    for m, f in zip(plain, interleaved, strict=True):
        ops.small_linear(gate_up, x, m.packed, None)
        fused.silu_and_mul(act_unfused, gate_up)
        ops.small_linear_silu_mul(act_fused, x, f.packed, None)
        same = same and torch.equal(act_unfused.view(torch.int16), act_fused.view(torch.int16))
    medians = (statistics.median(times["unfused"]) * 1e3, statistics.median(times["fused"]) * 1e3)
    return medians, same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,16,32,48,64,96,128", help="comma-separated M values")
    p.add_argument("--rounds", type=int, default=15, help="turns of each routing per M")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=LAYERS, help="gate_up weights (30 in SmolLM2)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ops, fused = load_linear_ops(), load_fused_ops()
    if ops is None or fused is None or not ops.small_linear_silu_mul_supported():
        print("the fused gate_up needs the C++ linear and fused ops with AMX-BF16 (switched on)", file=sys.stderr)
        return 1
    print_header("gate_up + SiLU-and-mul of a bf16 decode step, unfused against fused", "load_tests.bench_gate_up_silu")
    n, k = SHAPES["gate_up"]
    torch.manual_seed(0)
    plain: list[SmallMatmul] = []
    interleaved: list[GateUpSiluMul] = []
    for _ in range(args.layers):
        codes = random_gguf("gate_up", n, k)
        dense = codes.dequantize().to(torch.bfloat16)
        plain.append(SmallMatmul.pack(ops, dense, None, None, codes))
        fused_pack = GateUpSiluMul.pack(ops, dense, None, codes)
        assert fused_pack is not None
        interleaved.append(fused_pack)
    print(f"{args.layers} x gate_up {n} x {k} on Q4_1 codes, {args.threads} threads, medians of {args.rounds}\n")
    print("| rows | unfused ms | fused ms | fused / unfused | bitwise equal |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        (a, b), same = time_rows(ops, fused, plain, interleaved, rows, k, args.rounds)
        print(f"| {rows} | {a:.3f} | {b:.3f} | {b / a:.2f} | {'yes' if same else 'NO'} |", flush=True)
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
