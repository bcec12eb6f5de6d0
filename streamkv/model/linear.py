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
at 1-8 rows, and on par with it up to 32 (fp32) or 64 (bf16) rows, slower
past them (docs/benchmarks.md, "Small-batch linear"). So batches up to
:data:`SMALL_LINEAR_MAX_ROWS` for their dtype take it and larger ones
(prefill chunks) take oneDNN; the price is a second copy of every
projection weight in memory.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

# The measured crossovers (load_tests/bench_small_linear.py, quiet, 2 threads): bf16 is on par with oneDNN at
# 64 rows (1.01x) and behind at 128 (0.97x); fp32 is on par at 32 (0.98x) and behind at 64 (0.93x).
SMALL_LINEAR_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 64}


class Linear(nn.Linear):
    """``y = x W^T + b``, optionally from a oneDNN-prepacked ``W`` (and a small-batch copy) on the CPU.

    After :meth:`prepack` the dense weight is released and only the packed
    ones are used (inference only, CPU only).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed_weight: torch.Tensor | None = None
        self.small_weight: torch.Tensor | None = None
        self.small_bias: torch.Tensor | None = None  # float32, as the kernel adds it
        self.small_ops: ModuleType | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, in]`` -> ``[N, out]``."""
        if self.small_ops is not None and x.shape[0] <= SMALL_LINEAR_MAX_ROWS[x.dtype]:
            return small_linear(self.small_ops, x, self.small_weight, self.small_bias, self.out_features)
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    @torch.no_grad()
    def prepack(self, batch_size_hint: int, small_ops: ModuleType | None = None) -> None:
        """Reorder the weight for oneDNN (and, given ``small_ops``, for ``small_linear``); drop the dense copy.

        Raises:
            RuntimeError: oneDNN cannot take this dtype on this CPU (e.g. float16 without AVX512-FP16).
        """
        self.packed_weight = pack_linear_weight(self.weight, batch_size_hint)
        if small_ops is not None:
            self.small_weight = small_ops.pack_small_linear(self.weight.detach().contiguous())
            self.small_bias = None if self.bias is None else self.bias.detach().float().contiguous()
            self.small_ops = small_ops
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


def pack_linear_weight(weight: torch.Tensor, batch_size_hint: int) -> torch.Tensor:
    """oneDNN's blocked copy of a ``[out, in]`` weight for ``torch.ops.mkldnn._linear_pointwise``.

    These are the ops torch.compile's CPU backend (Inductor) freezes linears into.

    Raises:
        RuntimeError: oneDNN cannot take this dtype on this CPU.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_size_hint)


def small_linear(
    ops: ModuleType, x: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x [M, in] @ W^T (+ bias)`` -> ``[M, out_features]`` in ``x``'s dtype, ``W`` from ``pack_small_linear``.

    fp32 accumulates in fp32; bf16 multiplies bf16 pairs and accumulates in
    fp32, rounding once to bf16 (oneDNN's contract, another summation order).

    Raises:
        RuntimeError: ``packed`` was made for another shape or dtype (the op checks).
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = x.new_empty(x.shape[0], out_features)
    ops.small_linear(out, x, packed, bias)
    return out
