"""The tile matmul the attention kernels share, and how to configure it per dtype.

Two wrinkles it hides:

- fp32 inputs: ``tl.dot`` defaults to TF32 on NVIDIA (~1e-3 relative error),
  so fp32 asks for ``"ieee"``.
- bf16 under ``TRITON_INTERPRET=1``: the interpreter keeps bf16 as raw uint16
  and its ``tl.dot`` multiplies the bit patterns (triton-lang/triton#11584,
  unsupported upstream). There the operands are upcast to fp32 first; the
  products of bf16 values are exact in fp32, so this matches a bf16 MMA with
  fp32 accumulation up to summation order. Compiled kernels never take it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def tile_dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32; ``[M, K] x [K, N] -> [M, N]``."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


def dot_flags(dtype: torch.dtype) -> dict[str, object]:
    """``PRECISION`` / ``UPCAST`` constexprs for kernels calling :func:`tile_dot`."""
    return {
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "UPCAST": dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret),
    }
