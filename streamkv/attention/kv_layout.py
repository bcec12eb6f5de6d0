"""How a layer's KV state lies in memory: the KV cache dtype, (de)quantization, block copies.

One tensor per layer, block index on dim 1, whatever the KV dtype::

    unquantized (float32 / bfloat16 / float16):
        kv_cache [2, num_blocks, block_size, Hkv, D]            element = the dtype
    quantized (int8 / fp8_e4m3), the scale packed after each row:
        kv_cache [2, num_blocks, block_size, Hkv, D + 4]        element = int8 / float8_e4m3fn
                 row of one (token, head): | D codes | 4 bytes: float32 scale |
        x[d] ~= code[d] * scale,   scale = max_d |x[d]| / QMAX   (QMAX 127 for int8, 448 for e4m3)

Granularity: one scale per token and KV head (K and V separately). A token's
scale depends on that token's row only, so the write path stays a scatter of
finished rows: a later token arriving in the same block never re-quantizes
what is there (a per-block scale would have to grow, and re-encode the
block, whenever a new token's magnitude exceeded it). The cost is 4 bytes per
(token, head, K or V) on top of ``D`` one-byte codes: at ``D = 64`` a row is
68 bytes instead of 256 in fp32, 3.76x the tokens rather than 4x (float16
scales would give 3.88x, but rows of tiny values would then need subnormal
scales; float32 keeps every row's scale exact).

Why the scale sits inside the row rather than in a second ``[2, N, bs, Hkv]``
tensor: the model, the runner's swap and copy-on-write copies, and every
backend keep handling one tensor per layer (the model's signature does not
change), and a block copy moves codes and scales together by construction.
The invariant other code may rely on: each tensor of a layer's KV state has
the block index on dim 1, and :func:`streamkv.cache.block_copy.copy_blocks` is the
one way blocks move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamkv.config import KV_CACHE_DTYPES
from streamkv.ops.huge_pages import zeros_on_huge_pages

SCALE_BYTES = 4  # one float32 per (token, head) row of K and of V

_PLAIN = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_QUANT = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@dataclass(frozen=True, slots=True)
class KVCacheFormat:
    """A resolved KV cache dtype.

    Attributes:
        name: ``float32``, ``bfloat16``, ``float16``, ``int8`` or ``fp8_e4m3``.
        storage: element dtype of the cache tensor.
        quantized: rows carry a float32 scale after their ``D`` codes.
    """

    name: str
    storage: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.storage in _QMAX

    def row_width(self, head_dim: int) -> int:
        """Elements per (token, head) row of the cache tensor: ``D``, or ``D + 4`` when quantized."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one token costs across all layers: 2 (K, V) x layers x Hkv x row bytes (scales included)."""
        elem = torch.empty((), dtype=self.storage).element_size()
        return 2 * num_layers * num_kv_heads * self.row_width(head_dim) * elem


def resolve_kv_format(name: str, model_dtype: torch.dtype) -> KVCacheFormat:
    """The format of ``--kv-cache-dtype name``; ``auto`` stores KV in the model's compute dtype.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        plain = {v: k for k, v in _PLAIN.items()}
        if model_dtype not in plain:
            raise ValueError(f"no KV cache dtype for model dtype {model_dtype}")
        return KVCacheFormat(plain[model_dtype], model_dtype)
    if name in _PLAIN:
        return KVCacheFormat(name, _PLAIN[name])
    if name in _QUANT:
        return KVCacheFormat(name, _QUANT[name])
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {name!r}")


def allocate_kv_cache(
    fmt: KVCacheFormat,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device | str = "cpu",
    pin_memory: bool = False,
    zeroed: bool = True,
) -> torch.Tensor:
    """One layer's KV tensor ``[2, num_blocks, block_size, Hkv, row_width]`` in ``fmt.storage``.

    ``zeroed=False`` leaves it uninitialized (a host tier: a block is read only
    after a copy filled it, and untouched pages cost no memory until used).

    Raises:
        ValueError: a quantized format with ``head_dim`` not a multiple of 4
            (the float32 scale after the codes must stay 4-byte aligned).
    """
    if fmt.quantized and head_dim % SCALE_BYTES:
        raise ValueError(f"{fmt.name} KV needs head_dim divisible by {SCALE_BYTES}, not {head_dim}")
    shape = (2, num_blocks, block_size, num_kv_heads, fmt.row_width(head_dim))
    if not zeroed:
        return torch.empty(shape, dtype=fmt.storage, device=device, pin_memory=pin_memory)
    if torch.device(device).type != "cpu" or pin_memory:
        return torch.zeros(shape, dtype=fmt.storage, device=device, pin_memory=pin_memory)
    # The decode kernels read blocks anywhere in the pool: on 2 MiB pages they miss the TLB far less
    # (streamkv/ops/huge_pages.py).
    return zeros_on_huge_pages(shape, fmt.storage)


def is_quantized(kv_cache: torch.Tensor) -> bool:
    """True for an int8 or fp8 cache tensor (rows of codes + a float32 scale)."""
    return kv_cache.dtype in _QMAX


def quantize(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """Rows ``x [..., D]`` to packed bytes ``uint8 [..., D + 4]`` (codes, then the float32 scale).

    int8 rounds to nearest (ties to even) and clamps to +-127; fp8 e4m3 rounds
    as torch's cast does. An all-zero row gets scale 0 and codes 0.
    """
    qmax = _QMAX[storage]
    xf = x.float()
    # A tensor divisor, not the Python number: torch's CUDA division by a scalar multiplies by its reciprocal,
    # which is 1 ulp off the IEEE quotient in some rows, so the scale (and codes) differed from the Triton
    # store_kv's (div_rn) and from the CPU's on the first H200 run (docs/benchmarks.md, "Round 18").
    amax = xf.abs().amax(-1, keepdim=True)
    scale = amax / torch.full_like(amax, qmax)
    scaled = xf / torch.where(scale > 0, scale, 1.0)
    if storage == torch.int8:
        codes = scaled.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        codes = scaled.clamp_(-qmax, qmax).to(storage)
    return torch.cat((codes.view(torch.uint8), scale.view(torch.uint8)), -1)


def dequantize(rows: torch.Tensor, storage: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows ``uint8 [..., D + 4]`` (contiguous last dim) to ``[..., D]`` in ``dtype``."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :head_dim].view(storage).float()
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (codes * scale).to(dtype)


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Scatter a step's K and V ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping`` (int64 ``[T]``), in place.

    Quantized caches get each row's codes and scale; others a cast.
    """
    num_kv_heads, row = kv_cache.shape[3], kv_cache.shape[4]
    if is_quantized(kv_cache):
        flat = kv_cache.view(torch.uint8).view(2, -1, num_kv_heads, row)
        flat[0].index_copy_(0, slot_mapping, quantize(key, kv_cache.dtype))
        flat[1].index_copy_(0, slot_mapping, quantize(value, kv_cache.dtype))
        return
    flat = kv_cache.view(2, -1, num_kv_heads, row)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def as_stored(kv_cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x [T, Hkv, D]`` as ``kv_cache`` would give it back, in ``x``'s dtype (``x`` itself when lossless)."""
    if is_quantized(kv_cache):
        return dequantize(quantize(x, kv_cache.dtype), kv_cache.dtype, x.dtype)
    if kv_cache.dtype == x.dtype:
        return x
    return x.to(kv_cache.dtype).to(x.dtype)


def gather_rows(kv_cache: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K and V rows ``[2, len(rows), D]`` in ``dtype``; row ``slot * Hkv + h`` is head ``h`` of ``slot``.

    Args:
        kv_cache: ``[2, num_blocks, block_size, Hkv, row_width]``, contiguous.
        rows: int64 ``[R]`` indices into the ``[num_slots * Hkv]`` rows.
    """
    row = kv_cache.shape[4]
    if is_quantized(kv_cache):
        packed = kv_cache.view(torch.uint8).view(2, -1, row).index_select(1, rows)
        return dequantize(packed, kv_cache.dtype, dtype)
    return kv_cache.view(2, -1, row).index_select(1, rows).to(dtype)


def gather_slots(kv_cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K and V of whole slots ``[2, len(slots), Hkv, D]`` in ``dtype`` (a sequence's context for prefill)."""
    num_kv_heads, row = kv_cache.shape[3], kv_cache.shape[4]
    if is_quantized(kv_cache):
        packed = kv_cache.view(torch.uint8).view(2, -1, num_kv_heads, row).index_select(1, slots)
        return dequantize(packed, kv_cache.dtype, dtype)
    return kv_cache.view(2, -1, num_kv_heads, row).index_select(1, slots).to(dtype)
