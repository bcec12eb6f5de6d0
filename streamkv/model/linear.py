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
panel, which keeps it ahead of oneDNN up to 128 rows ("The small-batch kernel
past 8 rows"); past 128 rows (prefill chunks) it walks a thread's panels a
chunk at a time, pass by pass, within 1-5% of oneDNN at 4,096 rows
(docs/benchmarks.md, "Round 44"). It takes every batch size, so a row's result never depends on the rows
it is batched or chunked with: until round 44 prefill rows past 128 went to
oneDNN, whose sums run in another order, and in bf16 that changed greedy
tokens (a prompt alone and among 15 others decoded differently in 4-9 of 16
cases). No oneDNN copy of the weights is kept then; oneDNN runs the matmuls
only where the build has no kernel for the dtype. On a CPU without AVX-512
the fp32 kernel runs AVX2 tiles (3 rows x 32 columns up to 8 rows, 6 x 16 on
blocks of k past them, rows in blocks of 128) with the same summation order.

On a CPU with AMX-BF16 (Sapphire Rapids and later) the bf16 kernel runs on
AMX tiles (``tdpbf16ps``): there ``vdpbf16ps`` alone fell to 0.25x oneDNN's
AMX matmul at 64 rows, and the tile kernel is 1.2-1.3x oneDNN up to 32 rows
and on par at 64-128 (docs/benchmarks.md, "Round 15"); past 128 rows it walks
chunks of panels pass by pass ("Round 16"), where oneDNN was measured ahead
past 1,024 rows of qkv, o and down_proj: the price of batch-independent
results there, not yet measured on the whole prefill.

A float32 or bfloat16 model loaded from a GGUF (the default model: Q4_1
projections, a Q8_0 tied embedding) keeps each Q4_1 or Q8_0 weight's
small-batch copy as the GGUF's codes (:meth:`Linear.prepack` with
``codes``, :mod:`streamkv.model.gguf_codes`): the kernel dequantizes them as
it streams them, ~5 or 8.5 bits a weight instead of 32 or 16, and its
results are bitwise those of the float32 weights, or of their bf16
rounding on the bf16 kernels (AMX tiles or ``vdpbf16ps``).

Past :data:`GGUF_F32_AMX_MIN_ROWS` - 1 rows (prefill) a float32 model on the
codes runs on AMX tiles, where the CPU has them and the switch is on: x is
split into three bf16 pieces whose sum is x exactly, each product with a code
is exact, and the tiles sum in fp32. Its error against the exact product is
at fp32's level, counted against the terms it sums (Q4_1's ``d (q - 8) +
m'``, which can cancel where a weight is near zero; tests/test_gguf_codes.py).
A pass of 32 rows with an inf, a NaN or a value past 2^100 takes the FMA
path. The last bits differ from the decode rows' (on such a host an fp32 row's
result depends on its batch at that level, not bitwise), and a 4,096-row matmul
runs about 2.3x as fast as the FMA kernel (docs/benchmarks.md, "Round 32").

``--quantization int8`` (:func:`quantize_int8`, :meth:`Linear.prepack` with
``int8``) keeps only int8 codes and a float32 scale per output, run by the
int8 kernel of the same file at every batch size:
``vpdpwssd`` up to 3 rows and, on a CPU with AMX-INT8, AMX tiles from 4 rows,
with bitwise the same results.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from streamkv.model.gguf_codes import GGUF_CODE_DTYPES

if TYPE_CHECKING:
    from streamkv.model.gguf_codes import GGUFCodes

# Every batch size runs on the small-batch kernel (a weight with a SmallMatmul never takes oneDNN), on AVX-512 and
# AVX2 alike. The crossover measured in round 7
# (load_tests/bench_small_linear.py, 2 threads: 1.30x / 1.32x / 1.16x / 1.04x oneDNN at 16 / 32 / 64 / 128 rows in
# fp32, 1.52x / 1.43x / 1.25x / 1.15x in bf16, on par at 256) once sent prefill rows past 128 to oneDNN; since round
# 44 the kernel walks those a chunk of panels at a time (small_linear.cpp, run_panel_chunks) and one kernel takes
# them all, so a row's result does not depend on its batch or chunk. Whole offline runs, 32 x 128 tokens on the
# 2-core Zen 4, one process taking turns, medians of 3: the 4,096-row prefill step 2,175 -> 2,206 ms in bf16 and
# 4,367 -> 4,332 ms in fp32 on the default model's codes (docs/benchmarks.md, "Round 44").

# The fp32 kernel on GGUF codes runs passes of this many rows or more on AMX tiles while the switch is on
# (small_linear.cpp, GGUF_F32_AMX_MIN_ROWS, run_gguf_amx_f32: x = x1 + x2 + x3 in exact bf16 pieces, fp32 sums);
# fewer stay on the bitwise FMA path. SmolLM2's four projections at 4,096 rows: 37.7 ms a layer against oneDNN's
# fp32 85.5, at 512 rows 5.3 against 9.8 (2 threads; docs/benchmarks.md, "Round 32").
GGUF_F32_AMX_MIN_ROWS = 129

# K a multiple of this runs on bf16 AMX tiles (run_amx takes K in whole tile steps of 32); other weights run the
# vdpbf16ps kernel.
AMX_TILE_K = 32

# int8 weights, too, run on their kernel at every batch size: it streams half the bytes of bf16 at few rows, and one
# kernel for every row count keeps a row's result independent of the batch it is in. On AMX-INT8 its tile path
# (run_amx_int8, bitwise the vpdpwssd path's results) runs a decode step's matmuls 1.05-1.7x as fast as oneDNN's
# bf16 matmul at 16-128 rows and 0.64-0.72x at 4,096, where the vpdpwssd path alone was 0.23x
# (load_tests/bench_small_linear.py, int8 rows; docs/benchmarks.md "Round 30").
INT8_MAX = 127


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

    It runs every batch size, so a row's result never depends on the rows beside it (see the module's docstring).

    Attributes:
        ops: :func:`streamkv.ops.cpu_ops.load_linear_ops`'s module.
        packed: ``pack_small_linear`` (float) or ``pack_small_linear_int8`` (int8) of the weight.
        out_features: ``N``.
        scale: float32 ``[N]`` for int8 weights, else ``None``.
        bias: float32 ``[N]`` (the kernels add it in fp32) or ``None``.
    """

    ops: ModuleType
    packed: torch.Tensor
    out_features: int
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

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
        ``weight`` itself is packed. Either way every batch takes the kernel, with the same results (float32
        codes past ``GGUF_F32_AMX_MIN_ROWS`` - 1 rows on AMX tiles while the switch is on, to fp32's level)."""
        b = None if bias is None else bias.detach().float().contiguous()
        if int8 is not None:
            q, scale = int8
            packed = ops.pack_small_linear_int8(q.contiguous())
            return cls(ops, packed, q.shape[0], scale, b)
        w = weight.detach()
        if codes is not None and has_gguf_kernel(ops, w.dtype):
            packed = codes.pack(ops, bf16=w.dtype == torch.bfloat16)
        else:
            packed = ops.pack_small_linear(w.contiguous())
        return cls(ops, packed, w.shape[0], None, b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` (float32/bfloat16, any ``M``) -> ``[M, N]``.

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
        if self.small is not None:
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
        if self.small is None:  # no kernel for this dtype in this build: oneDNN runs every batch
            self.packed_weight = pack_linear_weight(weight, batch_size_hint)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


def pack_linear_weight(weight: torch.Tensor, batch_size_hint: int) -> torch.Tensor:
    """oneDNN's blocked copy of a ``[out, in]`` weight for ``torch.ops.mkldnn._linear_pointwise``.

    These are the ops torch.compile's CPU backend (Inductor) freezes linears into.

    Raises:
        RuntimeError: oneDNN cannot take this dtype on this CPU.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_size_hint)
