"""The CPU-fast linear layer: oneDNN-prepacked weights behind ``nn.Linear``'s interface, and a small-batch kernel.

torch's default CPU matmul goes through MKL, which on some x86 CPUs (AMD
EPYC among them) runs 1.3x (one row) to 2.5x (32+ rows) slower than oneDNN's
kernels on a weight reordered once into oneDNN's blocked layout (measured in
docs/benchmarks.md, "Physical limit"). In bf16 on a CPU with AVX512-BF16 the
same packed path uses the native bf16 dot-product instructions.

A decode step's matmuls have one row per sequence, and up to a few dozen rows
they are bound by the bytes of the weight. There oneDNN streams the weight at
15-19 GB/s on the 2-core EPYC where ``small_linear`` (``streamkv/ops/csrc/small_linear.cpp``,
its own packed copy of the weight) streams it at 21-24 GB/s: 1.3-1.6x faster
at 1-8 rows (docs/benchmarks.md, "Small-batch linear"). Past 8 rows it walks
each weight panel once per 12 rows from L2 while memory streams the next
panel, which keeps it ahead of oneDNN up to 128 rows and on par at 256
("The small-batch kernel past 8 rows"). So batches up to
:data:`SMALL_LINEAR_MAX_ROWS` for their dtype take it and larger ones
(prefill chunks) take oneDNN; the price is a second copy of every
projection weight in memory. On a CPU without AVX-512 the fp32 kernel runs
AVX2 tiles (3 rows x 32 columns up to 8 rows, 6 x 16 on blocks of k past
them, rows in blocks of 128) with the same summation order, and takes
every batch size: there it is the only copy of the weights.

On a CPU with AMX-BF16 (Sapphire Rapids and later) the bf16 kernel runs on
AMX tiles (``tdpbf16ps``): there ``vdpbf16ps`` alone fell to 0.25x oneDNN's
AMX matmul at 64 rows, and the tile kernel is 1.2-1.3x oneDNN up to 32 rows
and on par at 64-128, one kernel for every decode batch as before
(docs/benchmarks.md, "Round 15"). While AMX is on it also takes narrow bf16
weights (:data:`AMX_NARROW_MAX_COLUMNS` outputs or fewer) up to
:data:`AMX_NARROW_MAX_ROWS` rows, where oneDNN often leaves a thread idle
(:meth:`SmallMatmul.takes`; "Round 16").

A float32 or bfloat16 model loaded from a GGUF (the default model: Q4_1
projections, a Q8_0 tied embedding) keeps each Q4_1 or Q8_0 weight's
small-batch copy as the GGUF's codes (:meth:`Linear.prepack` with
``codes``, :mod:`streamkv.model.gguf_codes`): the kernel dequantizes them as
it streams them, ~5 or 8.5 bits a weight instead of 32 or 16, and its
results are bitwise those of the float32 weights, or of their bf16
rounding on the bf16 kernels (AMX tiles or ``vdpbf16ps``).

Past :data:`SMALL_LINEAR_MAX_ROWS` rows (prefill) a float32 model on the
codes runs on AMX tiles too, where the CPU has them: x is split into three
bf16 pieces whose sum is x exactly, each product with a code is exact, and
the tiles sum in fp32 (:data:`GGUF_F32_AMX_MAX_ROWS`). Its error against the
exact product is at fp32's level, counted against the terms it sums (Q4_1's
``d (q - 8) + m'``, which can cancel where a weight is near zero;
tests/test_gguf_codes.py). A pass of 32 rows with an inf, a NaN or a value
past 2^100 takes the FMA path. The last bits differ from the decode rows',
as oneDNN's did, and a 4,096-row matmul runs about 2.3x as fast as oneDNN's
fp32 one, which the FMA units bound (docs/benchmarks.md, "Round 32").

``--quantization int8`` (:func:`quantize_int8`, :meth:`Linear.prepack` with
``int8``) keeps only int8 codes and a float32 scale per output, run by the
int8 kernel of the same file at every batch size (:data:`INT8_MAX_ROWS`):
``vpdpwssd`` up to 3 rows and, on a CPU with AMX-INT8, AMX tiles from 4 rows,
with bitwise the same results.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from streamkv.model.gguf_codes import GGUF_CODE_DTYPES

if TYPE_CHECKING:
    from streamkv.model.gguf_codes import GGUFCodes

# The measured crossovers (load_tests/bench_small_linear.py, 2 threads, 2026-12-02 round 7): with passes of up
# to 12 rows and the next panel prefetched, the kernel is 1.30x / 1.32x / 1.16x / 1.04x oneDNN at 16 / 32 / 64
# / 128 rows in fp32 and 1.52x / 1.43x / 1.25x / 1.15x in bf16, on par (1.01x, 1.00x) at 256. Up to 128 rows
# covers every pure-decode batch of the default max_num_seqs (64) on one kernel, so a decode row's result does not
# depend on how many rows decode with it (a step that also carries a prefill chunk of more rows runs on oneDNN,
# whose sums run in another order, on the AMX kernel's narrow weights up to 1,024 rows, or for an fp32 model on
# the codes on AMX tiles from bf16 pieces: there the last bits can differ).
# On an Ice Lake Xeon (AVX-512 without AVX512-BF16; round 20) the fp32 kernel ran 1.22-1.39x / 1.31-1.49x /
# 1.48-1.53x / 1.27-1.31x / 1.15-1.16x oneDNN at 1 / 8 / 16 / 32 / 64 rows, 0.97-1.09x at 128 and 0.95-1.03x at 256
# (two runs): the same crossover.
SMALL_LINEAR_MAX_ROWS = {torch.float32: 128, torch.bfloat16: 128}
# An AVX2 build's fp32 kernel (no AVX-512; load_tests/bench_small_linear.py, 2 threads, 2026-12-03 round 10):
# 1.2-1.5x oneDNN at 1-32 rows, 1.2x at 64, 1.1x at 128, on par at 256; with rows in blocks of 512, on par or
# ahead at prefill sizes too (163-172 GFLOP/s against oneDNN's 135-169 at 512-4,096 rows, one weight in cache).
# So it takes every batch size: on such a CPU every fp32 matmul runs on one kernel, a row's result never depends
# on its batch or chunk, and no oneDNN copy of the weights is kept.
SMALL_LINEAR_MAX_ROWS_AVX2 = sys.maxsize

# bf16 on AMX tiles (run_amx, small_linear.cpp) also takes up to AMX_NARROW_MAX_ROWS rows of a weight with at most
# AMX_NARROW_MAX_COLUMNS outputs and K a multiple of AMX_TILE_K (in SmolLM2: qkv, o and down_proj, not gate_up or
# the LM head). On 2 threads oneDNN's bf16 matmul runs many of those shapes on one thread (o up to 768 rows,
# qkv at 768-1,024, down_proj from 256 to at least 1,280), while run_amx always splits the column pairs between
# the threads: at 512 and 1,024 rows down_proj runs 1.6-2.0x faster, qkv 1.1-1.7x, o 1.8x at 512 and 0.86-0.89x
# at 896-1,024 (docs/benchmarks.md, "Round 16"). Past 1,024 rows, and for gate_up past 128, oneDNN is ahead; but
# a bf16 MLP runs gate_up past 128 rows on this kernel with SiLU-and-mul in its epilogue (streamkv/model/swiglu.py).
# Only while the AMX switch is on: the vdpbf16ps kernel is 4x slower at these sizes.
AMX_NARROW_MAX_COLUMNS = 1024
AMX_NARROW_MAX_ROWS = 1024
AMX_TILE_K = 32  # run_amx takes K in whole tile steps of 32; other weights run the vdpbf16ps kernel

# A float32 model on the GGUF's codes: past SMALL_LINEAR_MAX_ROWS rows (prefill chunks), while AMX is on, the
# kernel runs fp32 on AMX tiles from exact bf16 pieces of x (small_linear.cpp, run_gguf_amx_f32; x = x1 + x2 + x3,
# each product exact, fp32 sums) instead of oneDNN's fp32 matmul, which the FMA units bound. SmolLM2's four
# projections at 4,096 rows: 37.7 ms a layer against oneDNN's 85.5, at 512 rows 5.3 against 9.8 (2 threads;
# docs/benchmarks.md, "Round 32"). With AMX off these rows take oneDNN as before.
GGUF_F32_AMX_MAX_ROWS = sys.maxsize

# int8 weights run on their kernel at every batch size: it streams half the bytes of bf16 at few rows, and one
# kernel for every row count keeps a row's result independent of the batch it is in. On AMX-INT8 its tile path
# (run_amx_int8, bitwise the vpdpwssd path's results) runs a decode step's matmuls 1.05-1.7x as fast as oneDNN's
# bf16 matmul at 16-128 rows and 0.64-0.72x at 4,096, where the vpdpwssd path alone was 0.23x
# (load_tests/bench_small_linear.py, int8 rows; docs/benchmarks.md "Round 30").
INT8_MAX_ROWS = sys.maxsize
INT8_MAX = 127


def small_linear_max_rows(ops: ModuleType, dtype: torch.dtype) -> int:
    """Most rows of ``x`` the small-batch kernel of ``ops`` takes for ``dtype`` weights; oneDNN takes more."""
    return SMALL_LINEAR_MAX_ROWS[dtype] if ops.small_linear_isa() == "avx512" else SMALL_LINEAR_MAX_ROWS_AVX2


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of a ``[N, K]`` weight: ``W[n, k] ~= q[n, k] * scale[n]``.

    ``scale[n] = max_k |W[n, k]| / 127`` and ``q = round(W / scale)`` in
    float32, so each weight is off by at most half a step (``scale / 2``);
    the scheme of torchao's ``int8_weight_only`` and gpt-fast. An all-zero
    row gets scale 1 (its codes are 0).

    Returns:
        ``q`` int8 ``[N, K]`` in [-127, 127], ``scale`` float32 ``[N]``.
    """
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale.contiguous()


def has_gguf_kernel(ops: ModuleType | None, dtype: torch.dtype = torch.float32) -> TypeGuard[ModuleType]:
    """Whether ``ops`` (:func:`streamkv.ops.cpu_ops.load_linear_ops`) runs ``dtype`` x on GGUF Q4_1 / Q8_0 codes:
    float32 on AVX-512, bfloat16 also needs AVX512-BF16; no other dtype."""
    if ops is None or dtype not in GGUF_CODE_DTYPES or not ops.small_linear_gguf_supported():
        return False
    return dtype == torch.float32 or bool(ops.small_linear_gguf_bf16_supported())


def has_int8_kernel(ops: ModuleType | None) -> TypeGuard[ModuleType]:
    """Whether ``ops`` (:func:`streamkv.ops.cpu_ops.load_linear_ops`) can run int8 weights (AVX-512 VNNI build)."""
    return ops is not None and bool(ops.small_linear_int8_supported())


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [N, K] * scale [N]`` in float32, cast to ``dtype``: the weight oneDNN runs for large batches."""
    return (q.float() * scale[:, None]).to(dtype)


@dataclass(frozen=True, slots=True)
class SmallMatmul:
    """One weight packed for the small-batch kernels: in its float dtype, or int8 with a scale per output.

    Attributes:
        ops: :func:`streamkv.ops.cpu_ops.load_linear_ops`'s module.
        packed: ``pack_small_linear`` (float) or ``pack_small_linear_int8`` (int8) of the weight.
        out_features: ``N``.
        max_rows: most rows of ``x`` sent to the kernel whichever its instructions (larger batches take oneDNN,
            but see ``amx_rows``).
        scale: float32 ``[N]`` for int8 weights, else ``None``.
        bias: float32 ``[N]`` (the kernels add it in fp32) or ``None``.
        amx_rows: most rows sent to the kernel while its AMX tiles are on (``AMX_NARROW_MAX_ROWS`` for narrow
            bf16 weights, ``GGUF_F32_AMX_MAX_ROWS`` for float32 GGUF codes, else ``max_rows``).
    """

    ops: ModuleType
    packed: torch.Tensor
    out_features: int
    max_rows: int
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    amx_rows: int = 0

    @classmethod
    def pack(
        cls,
        ops: ModuleType,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        int8: tuple[torch.Tensor, torch.Tensor] | None = None,
        codes: GGUFCodes | None = None,
    ) -> SmallMatmul:
        """Pack ``weight [N, K]`` (float32/bfloat16), or its int8 codes and scales ``int8 = (q, scale)``, or the
        GGUF ``codes`` that give ``weight`` bitwise (float32: their dequantization; bfloat16: its rounding). The
        codes are taken where ``ops`` has the GGUF kernel for ``weight``'s dtype (``has_gguf_kernel``); elsewhere
        ``weight`` itself is packed. Either way the same rows up to ``max_rows`` take the kernel, with the same
        results; float32 codes also take larger batches while AMX is on (``GGUF_F32_AMX_MAX_ROWS``), on tiles."""
        b = None if bias is None else bias.detach().float().contiguous()
        if int8 is not None:
            q, scale = int8
            packed = ops.pack_small_linear_int8(q.contiguous())
            return cls(ops, packed, q.shape[0], INT8_MAX_ROWS, scale, b, INT8_MAX_ROWS)
        w = weight.detach()
        max_rows = small_linear_max_rows(ops, w.dtype)
        narrow = w.dtype == torch.bfloat16 and w.shape[0] <= AMX_NARROW_MAX_COLUMNS and w.shape[1] % AMX_TILE_K == 0
        amx_rows = max(max_rows, AMX_NARROW_MAX_ROWS) if narrow else max_rows
        if codes is not None and has_gguf_kernel(ops, w.dtype):
            packed = codes.pack(ops, bf16=w.dtype == torch.bfloat16)
            if w.dtype == torch.float32:
                amx_rows = GGUF_F32_AMX_MAX_ROWS
        else:
            packed = ops.pack_small_linear(w.contiguous())
        return cls(ops, packed, w.shape[0], max_rows, None, b, amx_rows)

    def takes(self, rows: int) -> bool:
        """Whether ``rows`` rows of ``x`` run on this kernel (else oneDNN): ``max_rows``, or ``amx_rows`` under AMX."""
        return rows <= self.max_rows or (rows <= self.amx_rows and bool(self.ops.amx()))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` (float32/bfloat16, any ``M``; :meth:`takes` says where it is fastest) -> ``[M, N]``.

        Float weights: fp32 accumulates in fp32; bf16 multiplies bf16 pairs and
        accumulates in fp32, rounding once to bf16 (oneDNN's contract, another
        summation order). int8 weights: each row of ``x`` is quantized to int16
        (``max|x| / 32767`` per row, so an element is off by at most
        ``max|x| / 65534``), the products are summed exactly in int32, and the
        two scales are applied in fp32 (``small_linear.cpp``).

        Raises:
            RuntimeError: ``x`` does not fit the packed weight (the op checks).
        """
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = x.new_empty(x.shape[0], self.out_features)
        if self.scale is None:
            self.ops.small_linear(out, x, self.packed, self.bias)
        else:
            self.ops.small_linear_int8(out, x, self.packed, self.scale, self.bias)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight (and its scales)."""
        return self.packed.nbytes + (0 if self.scale is None else self.scale.nbytes)


class Linear(nn.Linear):
    """``y = x W^T + b``, optionally from a oneDNN-prepacked ``W`` (and a small-batch copy) on the CPU.

    After :meth:`prepack` the dense weight is released and only the packed
    ones are used (inference only, CPU only).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed_weight: torch.Tensor | None = None
        self.small: SmallMatmul | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, in]`` -> ``[N, out]``."""
        if self.small is not None and self.small.takes(x.shape[0]):
            return self.small(x)
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    @torch.no_grad()
    def prepack(
        self,
        batch_size_hint: int,
        small_ops: ModuleType | None = None,
        *,
        int8: bool = False,
        codes: GGUFCodes | None = None,
    ) -> None:
        """Reorder the weight for oneDNN and, given ``small_ops``, for the small-batch kernel; drop the dense copy.

        Where that kernel takes every batch size (fp32 on an AVX2 build) no
        oneDNN copy is kept. Given ``codes``, the GGUF codes of a float32 or
        bfloat16 weight (which they give bitwise, :mod:`streamkv.model.gguf_codes`),
        and a build with the GGUF kernel for that dtype, that kernel takes the
        small batches from the codes instead of a dense copy.

        With ``int8`` the weight becomes its int8 model (:func:`quantize_int8`)
        and, when the build has the int8 kernel, only the int8 codes are kept:
        that kernel runs every batch size. Without it oneDNN (and the float
        kernel) run the dequantized weight in the layer's dtype.

        Raises:
            RuntimeError: oneDNN cannot take this dtype on this CPU (e.g. float16 without AVX512-FP16).
        """
        weight = self.weight.detach()
        if int8:
            q = quantize_int8(weight)
            if has_int8_kernel(small_ops):
                self.small = SmallMatmul.pack(small_ops, weight, self.bias, q)
                self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
                return
            weight = dequantize_int8(*q, weight.dtype)
            codes = None  # the GGUF's codes give the weight, not its int8 model
        if small_ops is not None:
            self.small = SmallMatmul.pack(small_ops, weight, self.bias, codes=codes)
        if self.small is None or self.small.max_rows < sys.maxsize:  # oneDNN takes the rows the kernel does not
            self.packed_weight = pack_linear_weight(weight, batch_size_hint)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


def pack_linear_weight(weight: torch.Tensor, batch_size_hint: int) -> torch.Tensor:
    """oneDNN's blocked copy of a ``[out, in]`` weight for ``torch.ops.mkldnn._linear_pointwise``.

    These are the ops torch.compile's CPU backend (Inductor) freezes linears into.

    Raises:
        RuntimeError: oneDNN cannot take this dtype on this CPU.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_size_hint)
