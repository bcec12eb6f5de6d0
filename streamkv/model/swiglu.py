"""SwiGLU's gate_up with SiLU-and-mul in the matmul's epilogue: bf16 on AVX512-BF16 CPUs, float32 prefill on AVX-512.

A prefill step of 4,096 rows makes a ``[4096, 2 I]`` gate_up output (25 MB in
bf16 for SmolLM2) that goes to memory for ``silu_and_mul`` to read back and
halve. ``small_linear_silu_mul`` (``streamkv/ops/csrc/small_linear.cpp``)
writes only ``act [T, I]``: gate_up's rows are packed interleaved 16 at a time
(:func:`interleave_gate_up`), so each 32-column pass of the kernel holds
16 gate columns and their 16 up columns and applies SiLU-and-mul to them as
it stores them (on AMX tiles from the tiles' output; on ``vdpbf16ps`` from a
pass's ``[rows, 32]`` tile on the stack). Its result is bitwise ``silu_and_mul`` of the kernel's own
gate_up (the same tile sums, the same bf16 roundings and SiLU table), so a
row's MLP does not depend on whether it was prefilled or decoded, or in how
large a chunk. Against oneDNN's gate_up followed by ``silu_and_mul``
(``docs/benchmarks.md``, "Round 33") it took the prefill rows; since round
41 it takes a decode step's rows too (on the GGUF's codes the small-batch
kernel's own walk, the codes dequantized a tile step at a time up to 64
rows), which saves the separate ``silu_and_mul`` and its parallel region:
30 layers' gate_up at 1 / 8 / 32 / 64 rows 1.97 / 2.27 / 3.45 / 5.11 ms
unfused against 1.88 / 2.10 / 2.86 / 4.38 fused (``python -m
load_tests.bench_gate_up_silu``; docs/benchmarks.md, "Round 41").

Where the build has AVX512-BF16 (``small_linear_silu_mul_supported``): on
AMX tiles while the AMX switch is on, else on ``vdpbf16ps``, whose passes are
run_gguf_bf16's (or run()'s for a dense pack), so the bits are that kernel's
gate_up's. On ``vdpbf16ps`` the MLP takes it for prefill-sized steps (past 128
rows) alone: on the 2-core Zen 4 (no AMX) a 32 x 128-token bf16 prefill step
took 2,495 -> 2,381 ms, but a 32-row decode step 37.0 -> 39.1 ms
(:meth:`GateUpSiluMul.takes`; docs/benchmarks.md, "Round 45").
Elsewhere the MLP runs its gate_up matmul and ``silu_and_mul`` as before. The packed copy is the GGUF's
codes where the model has them (about 0.3 of the bf16 bytes for Q4_1), else
the dense bf16 weight.

Since round 47 a float32 model has it too (``run_silu_mul_f32``: the fp32 FMA
kernel's chunk walk, each pass into a ``[rows, 32]`` tile whose SiLU-and-mul
is ``silu_and_mul_f32``'s arithmetic, so bitwise the same ``act``), for
prefill-sized steps and with AMX off (on AMX tiles the fp32 kernel sums those
rows in another order, so a float32 model there keeps no fused copy). The
``[4096, 2 I]`` fp32 gate_up is 50 MB; 30 layers' MLP at 4,096 rows took
3,483 ms unfused in 1,024-row slices against 3,228 fused in one 4,096-row
slice (``MLP_SLICE_ROWS_WIDE``; docs/benchmarks.md, "Round 47"). Decode rows
keep the unfused kernel (a fused walk for them, which would have to keep
run_gguf's first-pass panel layout, was not built or measured). The copy
costs the codes' bytes again (32 MiB for SmolLM2's Q4_1).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from streamkv.model.linear import AMX_TILE_K, has_gguf_kernel

if TYPE_CHECKING:
    from streamkv.model.gguf_codes import GGUFCodes

# gate_up rows per group of the interleaved order: one AMX column block (small_linear.cpp's LANES).
INTERLEAVE = 16


def interleave_gate_up(intermediate: int) -> np.ndarray:
    """Row order of a ``[gate; up]`` weight ``[2 I, K]`` for ``small_linear_silu_mul``.

    Row ``32 q + j`` of the result is gate row ``16 q + j`` and row
    ``32 q + 16 + j`` is up row ``16 q + j`` (``j < 16``).

    Raises:
        ValueError: ``intermediate`` is not a multiple of 16.
    """
    if intermediate % INTERLEAVE:
        raise ValueError(f"intermediate size {intermediate} is not a multiple of {INTERLEAVE}")
    gate = np.arange(intermediate, dtype=np.int64).reshape(-1, INTERLEAVE)
    return np.concatenate([gate, gate + intermediate], axis=1).reshape(-1)


@dataclass(frozen=True, slots=True)
class GateUpSiluMul:
    """A bf16 or float32 gate_up weight packed interleaved for ``small_linear_silu_mul``.

    Attributes:
        ops: :func:`streamkv.ops.cpu_ops.load_linear_ops`'s module.
        packed: the interleaved weight, ``pack_small_linear`` or the GGUF codes' pack for ``dtype``.
        intermediate: ``I``, the columns of ``act``.
        bias: float32 ``[2 I]`` in the interleaved order, or None.
        dtype: the model's dtype, which ``x`` and ``act`` have.
    """

    ops: ModuleType
    packed: torch.Tensor
    intermediate: int
    bias: torch.Tensor | None
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def pack(
        cls,
        ops: ModuleType,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        codes: GGUFCodes | None = None,
    ) -> GateUpSiluMul | None:
        """Pack a bf16 or float32 ``[gate; up]`` weight ``[2 I, K]`` (or the GGUF ``codes`` that give it bitwise).

        Returns:
            None where the fused kernel cannot take it: a dtype this build has no fused kernel for
            (``small_linear_silu_mul_supported``: bfloat16 needs AVX512-BF16, float32 AVX-512), ``I`` not a
            multiple of 16 or ``K`` not of ``AMX_TILE_K``.
        """
        rows, k = weight.shape
        f32 = weight.dtype == torch.float32
        if weight.dtype not in (torch.bfloat16, torch.float32) or rows % (2 * INTERLEAVE) or k % AMX_TILE_K:
            return None
        if not ops.small_linear_silu_mul_supported(f32=f32):
            return None
        order = interleave_gate_up(rows // 2)
        index = torch.from_numpy(order)
        if codes is not None and has_gguf_kernel(ops, weight.dtype):
            packed = codes.rows(order).pack(ops, bf16=not f32)
        else:
            packed = ops.pack_small_linear(weight.detach()[index].contiguous())
        b = None if bias is None else bias.detach().float()[index].contiguous()
        return cls(ops, packed, rows // 2, b, weight.dtype)

    def takes(self, rows: int) -> bool:
        """Whether ``rows`` rows run fused (``small_linear_silu_mul_takes``; the bits are the same either way):
        bf16 any batch on AMX tiles, past 128 rows on ``vdpbf16ps``; float32 past 128 rows while AMX is off."""
        return bool(self.ops.small_linear_silu_mul_takes(rows, f32=self.dtype == torch.float32))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, K]`` in the weight's dtype -> ``act [T, I]`` = ``silu(x W_gate^T + b_gate) * (x W_up^T +
        b_up)``, as ``silu_and_mul`` of the kernel's own gate_up (bf16: each factor rounded to bf16 first).

        Raises:
            RuntimeError: ``x`` does not fit the packed weight (the op checks).
        """
        if x.stride(-1) != 1:
            x = x.contiguous()
        act = x.new_empty(x.shape[0], self.intermediate)
        self.ops.small_linear_silu_mul(act, x, self.packed, self.bias)
        return act

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight."""
        return self.packed.nbytes
