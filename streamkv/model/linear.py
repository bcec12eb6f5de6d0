"""The CPU-fast linear layer: oneDNN-prepacked weights behind ``nn.Linear``'s interface.

torch's default CPU matmul goes through MKL, which on some x86 CPUs (AMD EPYC
among them) runs 1.3x (one row) to 2.5x (32+ rows) slower than oneDNN's
kernels on a weight reordered once into oneDNN's blocked layout (measured in
docs/benchmarks.md, "Physical limit"). In bf16 on a CPU with AVX512-BF16 the
same packed path uses the native bf16 dot-product instructions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """``y = x W^T + b``, optionally from a oneDNN-prepacked ``W`` on the CPU.

    torch's default CPU matmul goes through MKL, which on some x86 CPUs (AMD
    EPYC among them) runs 1.3x (one row) to 2.5x (32+ rows) slower than
    oneDNN's kernels on a weight reordered once into oneDNN's blocked layout.
    After :meth:`prepack` the dense weight is released and only the packed one
    is used (inference only, CPU only).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, in]`` -> ``[N, out]``."""
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    @torch.no_grad()
    def prepack(self, batch_size_hint: int) -> None:
        """Reorder the weight for oneDNN and drop the dense copy.

        Raises:
            RuntimeError: oneDNN cannot take this dtype on this CPU (e.g. float16 without AVX512-FP16).
        """
        self.packed_weight = pack_linear_weight(self.weight, batch_size_hint)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


def pack_linear_weight(weight: torch.Tensor, batch_size_hint: int) -> torch.Tensor:
    """oneDNN's blocked copy of a ``[out, in]`` weight for ``torch.ops.mkldnn._linear_pointwise``.

    These are the ops torch.compile's CPU backend (Inductor) freezes linears into.

    Raises:
        RuntimeError: oneDNN cannot take this dtype on this CPU.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_size_hint)
