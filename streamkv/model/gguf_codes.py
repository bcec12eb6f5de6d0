"""The GGUF's Q4_1 and Q8_0 weights kept as their codes, for the small-batch kernel's exact fp32 and bf16 paths.

The default model is a Q4_1 GGUF: every projection weight is blocks of 32
4-bit codes ``q`` with a float16 scale ``d`` and minimum ``m``, and the
float32 model transformers loads holds ``W = d * q + m`` (gguf-py's
dequantization, in fp32). ``d`` has 11 significant bits and ``q`` 4, so
``d * q`` is exact and each weight is one rounding of ``d * q + m``: the
codes give every weight bitwise. Its token embedding, which is also its LM
head (tied), is Q8_0: int8 codes with a float16 ``d`` per block of 32, and
``W = d * q`` is exact outright (11 bits times 8). ``small_linear.cpp``'s
GGUF kernel dequantizes the codes as it streams them and runs the fp32
kernel's sums in the same order, so a decode step reads ~5 bits (Q4_1) or
8.5 bits (Q8_0) a weight instead of 32 and its logits are bitwise those of
the float32 weights. A bfloat16 model holds each weight rounded once to
bf16; its kernel rounds the same fp32 dequantization the same way (into a
bf16 panel for the AMX tiles or ``vdpbf16ps``; without AMX, up to 12
rows, straight from registers into ``vdpbf16ps``), so a bf16 decode step reads
the codes instead of 16 bits a weight, with the bf16 weights' bits.

:func:`read_gguf_codes` reads the codes of each projection, fused as our
model fuses them (``qkv_proj`` = q, k, v rows; ``gate_up_proj`` = gate, up),
with q's and k's rows in transformers' order (its GGUF loader undoes
llama.cpp's RoPE permutation of them, ``LlamaTensorProcessor``), and of the
LM head, and keeps a weight's codes only when they dequantize to the loaded
weight bitwise. It finds them through a :class:`GGUFTensor` table: gguf-py's
reader builds one (:func:`gguf_tensor_table`, ~3 s for the default model,
nearly all of it parsing the metadata), or a GGUF cache entry holds it
(:mod:`streamkv.model.gguf_cache`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Container, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import numpy as np
import torch

logger = logging.getLogger(__name__)

GGUF_BLOCK = 32  # weights per block (Q4_1 and Q8_0)
# The dtypes of the loaded weights the codes can stand for (streamkv.model.linear.has_gguf_kernel says which a
# build runs): float32, their dequantization; bfloat16, its rounding to nearest-even.
GGUF_CODE_DTYPES = (torch.float32, torch.bfloat16)
Q4_1_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of codes (element i low nibble of byte i, 16 + i high)
Q8_0_BLOCK_BYTES = 34  # float16 d, 32 int8 codes


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
        qs = self.codes.view(n, blocks, GGUF_BLOCK // 2)
        q = torch.cat([qs & 0xF, qs >> 4], dim=2).float()
        return (self.d.float()[:, :, None] * q + self.m.float()[:, :, None]).reshape(n, blocks * GGUF_BLOCK)

    def rows(self, index: np.ndarray) -> Q4_1Codes:
        """The weight's rows in the order of ``index`` (row ``i`` of the result is row ``index[i]``)."""
        idx = torch.from_numpy(index)
        return Q4_1Codes(self.codes[idx], self.d[idx], self.m[idx])

    @staticmethod
    def cat(parts: list[Q4_1Codes]) -> Q4_1Codes:
        """The weights' rows one after another (a fused projection)."""
        return Q4_1Codes(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "d", "m")))

    def pack(self, ops: ModuleType, bf16: bool = False) -> torch.Tensor:
        """``ops.small_linear``'s packed copy (``pack_small_linear_q4_1``): uint8 ``[N/32, K/32, 640]`` for float32
        x, or with ``bf16`` ``[N/32, K/32, 40, 16]`` for bfloat16 x (the weights rounded to bf16)."""
        return ops.pack_small_linear_q4_1(self.codes, self.d, self.m, bf16)


@dataclass(frozen=True, slots=True)
class Q8_0Codes:
    """One ``[N, K]`` weight as Q8_0 blocks along ``K``.

    Attributes:
        codes: int8 ``[N, K]``.
        d: float16 ``[N, K/32]``, the blocks' scales.
    """

    codes: torch.Tensor
    d: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``: ``d * q`` in fp32, as gguf-py computes it (exact: 11 significant bits times 8)."""
        n, blocks = self.d.shape
        q = self.codes.view(n, blocks, GGUF_BLOCK).float()
        return (self.d.float()[:, :, None] * q).reshape(n, blocks * GGUF_BLOCK)

    def rows(self, index: np.ndarray) -> Q8_0Codes:
        """The weight's rows in the order of ``index`` (row ``i`` of the result is row ``index[i]``)."""
        idx = torch.from_numpy(index)
        return Q8_0Codes(self.codes[idx], self.d[idx])

    @staticmethod
    def cat(parts: list[Q8_0Codes]) -> Q8_0Codes:
        """The weights' rows one after another (a fused projection)."""
        return Q8_0Codes(torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]))

    def pack(self, ops: ModuleType, bf16: bool = False) -> torch.Tensor:
        """``ops.small_linear``'s packed copy (``pack_small_linear_q8_0``): uint8 ``[N/32, K/32, 1088]`` for float32
        x, or with ``bf16`` ``[N/32, K/32, 68, 16]`` for bfloat16 x (the weights rounded to bf16)."""
        return ops.pack_small_linear_q8_0(self.codes, self.d, bf16)


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """Where one tensor's bytes lie in a GGUF file.

    Attributes:
        type: its ``GGMLQuantizationType`` value (3 is Q4_1, 8 is Q8_0).
        offset: bytes from the start of the file to its data.
        rows: its rows (gguf-py's first data dimension; 1 for a vector).
        nbytes: its bytes; row ``i`` is ``nbytes // rows`` bytes from ``offset + i * nbytes // rows``.
    """

    type: int
    offset: int
    rows: int
    nbytes: int

    def read(self, data: np.ndarray) -> np.ndarray:
        """Its bytes as uint8 ``[rows, nbytes // rows]``, a view of ``data`` (the whole file, uint8)."""
        return data[self.offset : self.offset + self.nbytes].reshape(self.rows, -1)


def gguf_tensor_table(path: Path) -> dict[str, GGUFTensor]:
    """Every tensor of the GGUF at ``path``, by name, through gguf-py's reader (seconds: it parses all metadata).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a GGUF file (gguf-py's error).
    """
    from gguf import GGUFReader

    table = {}
    for t in GGUFReader(path).tensors:
        rows = t.data.shape[0] if t.data.ndim > 1 else 1
        table[t.name] = GGUFTensor(int(t.tensor_type), int(t.data_offset), int(rows), int(t.n_bytes))
    return table


GGUFCodes = Q4_1Codes | Q8_0Codes
_C = TypeVar("_C", Q4_1Codes, Q8_0Codes)


def _from_blocks(raw: np.ndarray) -> Q4_1Codes:
    """A GGUF Q4_1 tensor's bytes, ``[N, K/32 * 20]`` uint8, as codes, d and m."""
    blocks = raw.reshape(raw.shape[0], -1, Q4_1_BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[:, :, 0]
    m = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[:, :, 0]
    codes = np.ascontiguousarray(blocks[:, :, 4:]).reshape(raw.shape[0], -1)
    return Q4_1Codes(torch.from_numpy(codes), torch.from_numpy(d.copy()), torch.from_numpy(m.copy()))


def _q8_0_from_blocks(raw: np.ndarray) -> Q8_0Codes:
    """A GGUF Q8_0 tensor's bytes, ``[N, K/32 * 34]`` uint8, as codes and d."""
    blocks = raw.reshape(raw.shape[0], -1, Q8_0_BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[:, :, 0]
    codes = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(raw.shape[0], -1)
    return Q8_0Codes(torch.from_numpy(codes), torch.from_numpy(d.copy()))


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
LM_HEAD = "lm_head"  # read_gguf_codes' name for the LM head: the GGUF's output.weight, else token_embd.weight (tied)


def _rope_rows(codes: _C, heads: int | None) -> _C:
    """q's and k's rows (``heads`` given) in transformers' order; other weights as they are."""
    return codes if heads is None else codes.rows(_unpermute(codes.codes.shape[0], heads))


def _sources(name: str, tensor_names: Container[str]) -> list[str] | None:
    """The GGUF tensors (in row order) that make up our weight ``name``, or None when it is not one we fuse."""
    if name == LM_HEAD:
        return ["output.weight" if "output.weight" in tensor_names else "token_embd.weight"]
    match = _PROJECTION.fullmatch(name)
    if match is None or match.group(2) not in FUSED_SOURCES:
        return None
    return [f"blk.{match.group(1)}.{src}.weight" for src in FUSED_SOURCES[match.group(2)]]


def read_gguf_codes(
    path: Path,
    weights: Mapping[str, torch.Tensor],
    num_heads: int,
    num_kv_heads: int,
    table: Mapping[str, GGUFTensor] | None = None,
) -> dict[str, GGUFCodes]:
    """The weights of ``weights`` whose GGUF tensors are all Q4_1 or all Q8_0 and give the weight bitwise: their
    float32 dequantization, rounded to nearest-even for a bfloat16 weight (as ``Tensor.to`` rounds).

    Call before the dense weights are dropped (``LlamaForCausalLM.prepack_cpu_weights``).

    Args:
        path: the ``.gguf`` file the model was loaded from.
        weights: name -> its loaded float32 or bfloat16 weight ``[N, K]``: our projections' module names
            (``model.layers.{i}.self_attn.qkv_proj``, ``...mlp.gate_up_proj``, ...) and :data:`LM_HEAD`; other
            names are ignored.
        num_heads, num_kv_heads: the model's query and KV heads (q's and k's rows are unpermuted by them).
        table: the file's tensors (:func:`gguf_tensor_table`, or a GGUF cache entry's); None reads it.

    Returns:
        Name -> its codes; the others are left out (another quantization in the file, or codes that do not give
        the loaded weight, which is logged).
    """
    from gguf import GGMLQuantizationType

    tensors = gguf_tensor_table(path) if table is None else table
    data = np.memmap(path, dtype=np.uint8, mode="r")
    heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
    found: dict[str, GGUFCodes] = {}
    for name, weight in weights.items():
        sources = _sources(name, tensors)
        if sources is None:
            continue
        types = {tensors[src].type if src in tensors else None for src in sources}
        kind = types.pop() if len(types) == 1 else None
        if kind not in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
            continue
        fused: GGUFCodes
        try:
            raw = [(tensors[src].read(data), heads.get(src.split(".")[-2])) for src in sources]
            if kind == GGMLQuantizationType.Q4_1:
                fused = Q4_1Codes.cat([_rope_rows(_from_blocks(data), h) for data, h in raw])
            else:
                fused = Q8_0Codes.cat([_rope_rows(_q8_0_from_blocks(data), h) for data, h in raw])
            usable = weight.dtype in GGUF_CODE_DTYPES and torch.equal(fused.dequantize().to(weight.dtype), weight)
        except (ValueError, RuntimeError):  # a table whose shapes do not fit the weight (a damaged cache entry's)
            usable = False
        if usable:
            found[name] = fused
        else:
            kind_name = GGMLQuantizationType(kind).name
            logger.warning(
                "%s: the GGUF's %s codes do not give the loaded weight; kept in %s",
                name,
                kind_name,
                str(weight.dtype).removeprefix("torch."),
            )
    return found
