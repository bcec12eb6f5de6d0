"""A decode step's matmuls: oneDNN's packed matmul against the small-batch kernel, by rows, on SmolLM2's shapes.

Every projection of the 30 layers (qkv 960 x 576, o 576 x 576, gate_up 3072 x
576, down 576 x 1536, each with its own weight, so the weights stream from
memory as in a decode step) plus the LM head (49152 x 576), for M rows of x.
Both kernels run interleaved, the best of ``--rounds`` per kernel is printed
with the weight bytes it streamed per second; the first line is a plain read
of a 512 MiB tensor (``torch.sum``), the machine's reference bandwidth.
``int8`` rows run ``--quantization int8``'s matmuls: bf16 x against the int8
kernel (its GB/s count int8 bytes) and oneDNN on the dequantized bf16
weights (the matmul an int8 model ran before its kernel took every batch). ``gguf`` rows run a float32
model of the default GGUF: the projections on Q4_1 codes and the LM head on
Q8_0 codes (the kernel's GB/s count the codes' bytes), against oneDNN on the
float32 weights; ``gguf_bf16`` rows the same codes in a bfloat16 model,
against oneDNN on the bf16 weights.

    .venv/bin/python -m load_tests.bench_small_linear                       # 2 threads, M = 1 .. 128
    .venv/bin/python -m load_tests.bench_small_linear --rows 1,8 --dtypes bfloat16,int8 --threads 1
    .venv/bin/python -m load_tests.bench_small_linear --dtypes float32,gguf
    .venv/bin/python -m load_tests.bench_small_linear --dtypes bfloat16,gguf_bf16
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from streamkv.model.gguf_codes import GGUFCodes, Q4_1Codes, Q8_0Codes  # noqa: E402
from streamkv.model.linear import SmallMatmul, dequantize_int8, has_gguf_kernel, quantize_int8  # noqa: E402
from streamkv.ops.cpu_ops import load_linear_ops, set_amx  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30


def read_bandwidth() -> float:
    """GB/s of ``torch.sum`` over 512 MiB of float32 (best of 5)."""
    x = torch.ones(128 * 2**20)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(5))
    return x.nbytes / best / 1e9


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_rows(
    ops: ModuleType,
    onednn: dict[str, list[torch.Tensor]],
    small: dict[str, list[SmallMatmul]],
    rows: int,
    dtype: torch.dtype,
    rounds: int,
) -> tuple[float, float]:
    """Best seconds of (oneDNN, small-batch kernel) over every weight, ``rows`` rows of x, interleaved rounds."""
    xs = {s: torch.randn(rows, dims[1]).to(dtype) for s, dims in SHAPES.items()}

    def run_onednn() -> None:
        for s, packed in onednn.items():
            for p in packed:
                torch.ops.mkldnn._linear_pointwise(xs[s], p, None, "none", [], "")

    def run_small() -> None:
        for s, kernels in small.items():
            for kernel in kernels:
                kernel(xs[s])

    run_onednn()
    run_small()
    onednn_s, small_s = [], []
    for _ in range(rounds):  # interleaved, so load drifts hit both alike
        onednn_s.append(_timed(run_onednn))
        small_s.append(_timed(run_small))
    return min(onednn_s), min(small_s)


def pack(
    ops: ModuleType, name: str, layers: int
) -> tuple[dict[str, list[torch.Tensor]], dict[str, list[SmallMatmul]], int, torch.dtype]:
    """oneDNN's and the small kernel's copies of random SmolLM2-shaped weights; bytes the kernel streams; x dtype."""
    int8, gguf = name == "int8", name.startswith("gguf")
    dtype = torch.bfloat16 if int8 or name == "gguf_bf16" else torch.float32 if gguf else getattr(torch, name)
    onednn: dict[str, list[torch.Tensor]] = {}
    small: dict[str, list[SmallMatmul]] = {}
    for shape, dims in SHAPES.items():
        onednn[shape], small[shape] = [], []
        for _ in range(1 if shape == "lm_head" else layers):
            w = (torch.randn(*dims) * 0.02).to(dtype)
            codes = quantize_int8(w) if int8 else None
            blocks = random_gguf(shape, *dims) if gguf else None
            dense = w if blocks is None else blocks.dequantize().to(dtype)
            if codes is not None:
                dense = dequantize_int8(*codes, dtype)
            onednn[shape].append(torch.ops.mkldnn._reorder_linear_weight(dense, 32))
            small[shape].append(SmallMatmul.pack(ops, dense, None, codes, blocks))
    nbytes = sum(k.packed.nbytes for ks in small.values() for k in ks)
    return onednn, small, nbytes, dtype


def random_gguf(shape: str, n: int, k: int) -> GGUFCodes:
    """Random codes of an ``[n, k]`` weight as the default GGUF has them: Q8_0 for the LM head, else Q4_1."""
    d = (torch.rand(n, k // 32) * 0.01 + 1e-4).half()
    if shape == "lm_head":
        return Q8_0Codes(torch.randint(-127, 128, (n, k), dtype=torch.int8), d)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    return Q4_1Codes(codes, d, (-torch.rand(n, k // 32) * 0.08).half())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128", help="comma-separated M values")
    ap.add_argument(
        "--dtypes",
        default="float32,bfloat16,bfloat16-vdpbf16ps,int8",
        help="float32, bfloat16 (on AMX tiles where the CPU has them), bfloat16-vdpbf16ps (AMX off; only where it"
        " is on by default), int8 (bf16 x, int8 weights), gguf (float32 x, the projections as GGUF Q4_1 codes, the"
        " LM head as Q8_0 codes, as the default model runs in float32), gguf_bf16 (the same codes under bf16 x, as"
        " the default model runs in bfloat16: the kernel's GB/s count the codes' bytes)",
    )
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--layers", type=int, default=LAYERS, help="weights per projection shape (30 in SmolLM2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ops = load_linear_ops()
    if ops is None:
        print("the small-batch linear op is not available here (needs AVX-512 BF16 or AVX2, and a compiler)")
        return 1
    print(
        f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}, read bandwidth {read_bandwidth():.1f} GB/s, "
        f"bf16 kernel on AMX tiles: {'yes' if ops.amx() else 'no'}, "
        f"int8 kernel on AMX tiles from 4 rows: {'yes' if ops.small_linear_int8_amx() else 'no'}"
    )
    print("| dtype | rows | oneDNN ms | oneDNN GB/s | small_linear ms | small_linear GB/s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        if name == "int8" and not ops.small_linear_int8_supported():
            print("| int8 | - | the int8 kernel needs AVX512-VNNI |")
            continue
        if name == "gguf" and not ops.small_linear_gguf_supported():
            print("| gguf | - | the GGUF kernel needs AVX-512 |")
            continue
        if name == "gguf_bf16" and not has_gguf_kernel(ops, torch.bfloat16):
            print("| gguf_bf16 | - | the bf16 GGUF kernel needs AVX512-BF16 |")
            continue
        if name == "bfloat16" and not ops.small_linear_bf16_supported():
            print("| bfloat16 | - | the bf16 kernel needs AVX512-BF16 |")
            continue
        amx = ops.amx()
        if name == "bfloat16-vdpbf16ps" and not amx:
            continue  # the bfloat16 rows already ran that kernel
        onednn, small, nbytes, dtype = pack(ops, name.split("-")[0], args.layers)
        fp32_bytes = sum(n * k * 4 * (1 if s == "lm_head" else args.layers) for s, (n, k) in SHAPES.items())
        set_amx(amx and name != "bfloat16-vdpbf16ps")
        for rows in (int(r) for r in args.rows.split(",")):
            a, b = time_rows(ops, onednn, small, rows, dtype, args.rounds)
            # int8: oneDNN streams the bf16 weights; gguf: the float32 ones; gguf_bf16: the bf16 ones
            if name == "int8":
                onednn_bytes = nbytes * 2
            elif name.startswith("gguf"):
                onednn_bytes = fp32_bytes // (2 if name == "gguf_bf16" else 1)
            else:
                onednn_bytes = nbytes
            print(
                f"| {name} | {rows} | {a * 1e3:.2f} | {onednn_bytes / a / 1e9:.1f} | {b * 1e3:.2f} "
                f"| {nbytes / b / 1e9:.1f} | {a / b:.2f}x |"
            )
        set_amx(amx)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
