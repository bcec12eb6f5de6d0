"""Greedy tokens of a float32 LM head at bf16 speed, exactly: most of the fp32 logits are never computed.

A greedy step needs only each row's argmax. :class:`GreedyHead` runs the LM
head in bf16 (the ``small_linear`` bf16 kernel: ``vdpbf16ps``, or AMX tiles,
twice the fp32 FMA rate) for an estimate ``a`` of the logits, bounds its
distance from the fp32 kernel's logits by ``c1 ||x|| ||W_v|| + c2 |a_v|``
(``streamkv/ops/csrc/greedy_head.cpp`` derives ``c1`` and ``c2``; Higham,
*Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec. 3.1), and
computes exactly, on the fp32 kernel's own chain, only the logits the bound
cannot rule out: the token is the argmax of the full fp32 head, bitwise (the
first index on ties, as ``torch.argmax``).

On SmolLM2-135M (a 49,152 x 576 head, Q8_0 codes) 1,152 decode rows had a
median of 1 such candidate, a 99th percentile of 94 and at most 189; at 32 rows the head and argmax took
5.3 ms against 9.5 for the fp32 head (docs/benchmarks.md, "Round 46"). It
serves the rows of a step whose every sampling row is greedy without
logprobs, beams, ``n > 1`` or a pending ``min_tokens`` (``EngineCore``);
any other step computes the logits.
"""

from __future__ import annotations

from types import ModuleType

import torch

from streamkv.model.gguf_codes import GGUFCodes
from streamkv.model.linear import SmallMatmul

# Rows the estimate runs from. SmolLM2's head and argmax, fp32 against this head (best of 20, the same run): 1 row
# 0.78 / 0.76 ms (level: one row streams the weight either way), 2 rows 1.03 / 0.88, 4 rows 1.56 / 1.07, 8 rows
# 2.77 / 1.53, 32 rows 9.48 / 5.30, 64 rows 18.07 / 9.67 (docs/benchmarks.md, "Round 46").
GREEDY_HEAD_MIN_ROWS = 2
# Rows it runs to: the fp32 kernel's FMA chain, which the exact logits repeat, runs up to 128 rows on every CPU
# (past them an AMX host's fp32 GGUF head sums in another order: GGUF_F32_AMX_MIN_ROWS).
GREEDY_HEAD_MAX_ROWS = 128


class GreedyHead:
    """A float32 LM head's greedy tokens from its bf16 estimate and exact fp32 candidates.

    Attributes:
        ops: :func:`streamkv.ops.cpu_ops.load_linear_ops`'s module.
        estimate: the head packed for the bf16 kernel (from its GGUF Q8_0 codes where given).
        exact: the fp32 head's ``small_linear`` pack (Q8_0 codes or dense fp32), which the exact logits read.
        row_norms: float32 ``[V]``: each row's L2 norm, rounded up.
    """

    def __init__(self, ops: ModuleType, estimate: SmallMatmul, exact: torch.Tensor, row_norms: torch.Tensor) -> None:
        self.ops = ops
        self.estimate = estimate
        self.exact = exact
        self.row_norms = row_norms
        self.candidates = 0  # exact logits computed so far (tests, benchmarks)

    @classmethod
    def build(
        cls, ops: ModuleType | None, weight: torch.Tensor, head: SmallMatmul | None, codes: GGUFCodes | None = None
    ) -> GreedyHead | None:
        """The greedy head of float32 ``weight [V, K]`` run by ``head``; ``None`` where it cannot serve.

        Args:
            ops: the linear op set; it needs the bf16 kernel (AVX512-BF16) and ``greedy_head``.
            weight: the LM head's float32 weight (its dequantized codes when ``codes`` is given).
            head: the fp32 head's :class:`SmallMatmul`; its pack must be dense fp32 or Q8_0 codes.
            codes: the head's GGUF codes (:mod:`streamkv.model.gguf_codes`), or ``None``.
        """
        if ops is None or head is None or head.scale is not None or head.bias is not None:
            return None
        if weight.dtype != torch.float32 or not ops.small_linear_bf16_supported() or not hasattr(ops, "greedy_head"):
            return None
        packed = head.packed
        dense = packed.dtype == torch.float32 and packed.dim() == 3
        q8 = packed.dtype == torch.uint8 and packed.dim() == 3 and packed.shape[2] == 1088
        if not (dense or q8):  # Q4_1 codes: no exact path written for them
            return None
        if not bool(weight.detach().abs().max() < 2**16):  # the bound's flush-to-zero term assumes |W| < 2^16
            return None
        # From the codes where the bf16 GGUF kernel runs them (0.53 of the dense bf16 bytes), else the dense weight.
        estimate = SmallMatmul.pack(ops, weight.detach().to(torch.bfloat16), codes=codes)
        norms = weight.detach().double().norm(dim=1)
        up = norms.float()
        up = torch.where(up.double() < norms, torch.nextafter(up, torch.full_like(up, float("inf"))), up)
        return cls(ops, estimate, packed, up.contiguous())

    def takes(self, rows: int) -> bool:
        """Whether a step of ``rows`` greedy rows runs here."""
        return GREEDY_HEAD_MIN_ROWS <= rows <= GREEDY_HEAD_MAX_ROWS

    def __call__(self, hidden: torch.Tensor) -> list[int] | None:
        """``hidden [M, K]`` float32 -> each row's greedy token, or ``None`` when a row needs the full fp32 head
        (a non-finite hidden row or estimate)."""
        x = hidden.contiguous()
        approx = self.estimate(x.to(torch.bfloat16))
        tokens = torch.empty(x.shape[0], dtype=torch.long)
        self.candidates += int(self.ops.greedy_head(tokens, x, approx, self.exact, self.row_norms))
        out = tokens.tolist()
        return None if -1 in out else out
