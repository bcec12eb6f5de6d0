"""Quantized KV rows in Triton: the per-row scale after the codes, load-and-dequantize, quantize-and-store.

The layout is :mod:`streamkv.attention.kv_layout`'s: a quantized row of one
(token, KV head) is ``HEAD_DIM`` one-byte codes followed by a float32 scale,
``x = code * scale``. ``QUANT`` is a constexpr: 0 plain rows (the cache's own
dtype), 1 int8 codes, 2 fp8 e4m3 codes (passed as a uint8 view and bitcast, so
the interpreter need not know float8).

Untested on a GPU so far (the machine this was written on has none): the
interpreter tests in ``tests/test_kv_quant_triton.py`` check them against the
torch path, and ``load_tests/gpu_check.sh`` runs the compiled ones when a GPU
is there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_QMAX = {1: 127.0, 2: 448.0}


def quant_mode(kv_cache: torch.Tensor) -> int:
    """The ``QUANT`` constexpr for a cache tensor."""
    if kv_cache.dtype == torch.int8:
        return 1
    if kv_cache.dtype == torch.float8_e4m3fn:
        return 2
    return 0


def kernel_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The tensor to hand a kernel: fp8 caches as uint8 (bitcast inside), others as they are."""
    return kv_cache.view(torch.uint8) if kv_cache.dtype == torch.float8_e4m3fn else kv_cache


def qmax(mode: int) -> float:
    return _QMAX.get(mode, 1.0)


@triton.jit
def _rint(t):
    """Round ``t >= 0`` to the nearest integer, ties to even (as torch.round), in fp32."""
    f = tl.floor(t)
    d = t - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    return f + tl.where(d > 0.5, 1.0, tl.where(d < 0.5, 0.0, odd))


@triton.jit
def _fp8_decode(raw):
    """e4m3fn codes (uint8) to fp32, by bits: exact, and free of the interpreter's float8 casts."""
    c = raw.to(tl.int32)
    e = (c >> 3) & 15
    m = c & 7
    pow2 = ((e + 117) << 23).to(tl.float32, bitcast=True)  # 2 ** (e - 10)
    mag = tl.where(e == 0, m.to(tl.float32) * (1.0 / 512.0), (8 + m).to(tl.float32) * pow2)
    mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
    return tl.where((c >> 7) == 1, -mag, mag)


@triton.jit
def _fp8_encode(x):
    """fp32 in [-448, 448] to e4m3fn codes (int32 0..255), round to nearest even, as torch's cast."""
    bits = x.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)  # 3 mantissa bits; rebias 127 -> 7
    subnormal = _rint(tl.abs(x) * 512.0).to(tl.int32)  # below 2 ** -6: steps of 2 ** -9
    code = tl.where(a >= (121 << 23), normal, subnormal)
    return tl.where(bits < 0, code | 0x80, code)


@triton.jit
def load_rows(base, tok_off, dims, mask_n, mask_d, stride_c_dim, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
              dtype: tl.constexpr):  # fmt: skip
    """Rows ``[BLOCK_N, BLOCK_D]`` at ``base + tok_off`` in ``dtype``, dequantized when ``QUANT``."""
    mask = mask_n[:, None] & mask_d[None, :]
    raw = tl.load(base + tok_off[:, None] + dims[None, :] * stride_c_dim, mask=mask, other=0)
    if QUANT == 0:
        return raw.to(dtype)
    if QUANT == 2:
        codes = _fp8_decode(raw)
    else:
        codes = raw.to(tl.float32)
    scale = tl.load((base + tok_off + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=mask_n, other=0.0)
    return (codes * scale[:, None]).to(dtype)


@triton.jit
def store_rows(dst, x, mask, scale_ptr, mask_h, QUANT: tl.constexpr, QMAX: tl.constexpr):
    """Store rows ``x [BLOCK_H, BLOCK_D]`` (fp32) at ``dst``; when ``QUANT`` their scales at ``scale_ptr [BLOCK_H]``.

    The same arithmetic as :func:`streamkv.attention.kv_layout.quantize`
    (IEEE divisions, ties to even), so both write the same bytes.
    """
    if QUANT == 0:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)
    else:
        x = tl.where(mask, x, 0.0)
        scale = tl.math.div_rn(tl.max(tl.abs(x), 1), QMAX)
        scaled = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
        scaled = tl.minimum(tl.maximum(scaled, -QMAX), QMAX)
        if QUANT == 2:
            codes = _fp8_encode(scaled)
        else:
            mag = _rint(tl.abs(scaled))
            codes = tl.where(scaled < 0, -mag, mag).to(tl.int32)
        tl.store(dst, codes.to(dst.dtype.element_ty), mask=mask)
        tl.store(scale_ptr.to(tl.pointer_type(tl.float32)), scale, mask=mask_h)
