"""The GGUF's Q4_1 projection weights kept as their codes, for the small-batch kernel's exact fp32 path.

The default model is a Q4_1 GGUF: every projection weight is blocks of 32
4-bit codes ``q`` with a float16 scale ``d`` and minimum ``m``, and the
float32 model transformers loads holds ``W = d * q + m`` (gguf-py's
dequantization, in fp32). ``d`` has 11 significant bits and ``q`` 4, so
``d * q`` is exact and each weight is one rounding of ``d * q + m``: the
codes give every weight bitwise. ``small_linear.cpp``'s Q4_1 kernel
dequantizes them as it streams them and runs the fp32 kernel's sums in the
same order, so a decode step reads ~5 bits a weight instead of 32 and its
logits are bitwise those of the float32 weights.

:func:`read_q4_1_projections` reads the codes of each projection, fused as
our model fuses them (``qkv_proj`` = q, k, v rows; ``gate_up_proj`` = gate,
up), with q's and k's rows in transformers' order (its GGUF loader undoes
llama.cpp's RoPE permutation of them, ``LlamaTensorProcessor``), and keeps a
weight's codes only when they dequantize to the loaded weight bitwise.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

Q4_1_BLOCK = 32  # weights per block
Q4_1_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of codes (element i low nibble of byte i, 16 + i high)


@dataclass(frozen=True, slots=True)
class Q4_1Codes:
    """One ``[N, K]`` weight as Q4_1 blocks along ``K``.

    Attributes:
        codes: uint8 ``[N, K/2]``, each block's 16 bytes in GGUF's order (byte ``i``: element ``i`` in the low
            nibble, element ``16 + i`` in the high).
        d: float16 ``[N, K/32]``, the blocks' scales.
        m: float16 ``[N, K/32]``, the blocks' minima.
    """

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``: ``d * q + m`` in fp32, as gguf-py computes it (``d * q`` is exact)."""
        n, blocks = self.d.shape
        qs = self.codes.view(n, blocks, Q4_1_BLOCK // 2)
        q = torch.cat([qs & 0xF, qs >> 4], dim=2).float()
        return (self.d.float()[:, :, None] * q + self.m.float()[:, :, None]).reshape(n, blocks * Q4_1_BLOCK)

    def rows(self, index: np.ndarray) -> Q4_1Codes:
        """The weight's rows in the order of ``index`` (row ``i`` of the result is row ``index[i]``)."""
        idx = torch.from_numpy(index)
        return Q4_1Codes(self.codes[idx], self.d[idx], self.m[idx])

    @staticmethod
    def cat(parts: list[Q4_1Codes]) -> Q4_1Codes:
        """The weights' rows one after another (a fused projection)."""
        return Q4_1Codes(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "d", "m")))


def _from_blocks(raw: np.ndarray) -> Q4_1Codes:
    """A GGUF Q4_1 tensor's bytes, ``[N, K/32 * 20]`` uint8, as codes, d and m."""
    blocks = raw.reshape(raw.shape[0], -1, Q4_1_BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[:, :, 0]
    m = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[:, :, 0]
    codes = np.ascontiguousarray(blocks[:, :, 4:]).reshape(raw.shape[0], -1)
    return Q4_1Codes(torch.from_numpy(codes), torch.from_numpy(d.copy()), torch.from_numpy(m.copy()))


def _unpermute(rows: int, heads: int) -> np.ndarray:
    """The row order transformers gives llama.cpp's permuted q / k rows (``_reverse_permute_weights``)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)


# Our fused projections (streamkv/model/llama.py) and the GGUF tensors of each, in row order.
FUSED_SOURCES = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
_PROJECTION = re.compile(r"model\.layers\.(\d+)\.(.+)")


def read_q4_1_projections(
    path: Path, weights: Mapping[str, torch.Tensor], num_heads: int, num_kv_heads: int
) -> dict[str, Q4_1Codes]:
    """The projections of ``weights`` whose GGUF tensors are all Q4_1 and dequantize to the weight bitwise.

    Call before the dense weights are dropped (``LlamaForCausalLM.prepack_cpu_weights``).

    Args:
        path: the ``.gguf`` file the model was loaded from.
        weights: module name (``model.layers.{i}.self_attn.qkv_proj``, ``...mlp.gate_up_proj``, ...) -> its
            loaded float32 weight; other names are ignored.
        num_heads, num_kv_heads: the model's query and KV heads (q's and k's rows are unpermuted by them).

    Returns:
        Module name -> its codes; the others are left out (another quantization in the file, or codes that do not
        give the loaded weight, which is logged).
    """
    from gguf import GGMLQuantizationType, GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
    found: dict[str, Q4_1Codes] = {}
    for name, weight in weights.items():
        match = _PROJECTION.fullmatch(name)
        if match is None or match.group(2) not in FUSED_SOURCES:
            continue
        parts = []
        for src in FUSED_SOURCES[match.group(2)]:
            t = tensors.get(f"blk.{match.group(1)}.{src}.weight")
            if t is None or t.tensor_type != GGMLQuantizationType.Q4_1:
                break
            codes = _from_blocks(np.asarray(t.data))
            parts.append(codes.rows(_unpermute(codes.codes.shape[0], heads[src])) if src in heads else codes)
        else:
            codes = Q4_1Codes.cat(parts)
            if weight.dtype == torch.float32 and torch.equal(codes.dequantize(), weight.detach()):
                found[name] = codes
            else:
                logger.warning("%s: the GGUF's Q4_1 codes do not give the loaded weight; kept in float32", name)
    return found
