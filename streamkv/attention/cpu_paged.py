"""CPU paged attention that reads K/V in place through the block table (C++ ops), decode and prefill rows.

Why a C++ op for decode: the torch reference (:mod:`streamkv.attention.torch_paged`)
gathers every sequence's whole context into a new head-major tensor in every
layer (one ``index_select`` of 256-byte rows) and then reads that copy again
in ``baddbmm`` / ``bmm``. That gather was 34% of a batch-32 decode step on the
2-core EPYC (docs/benchmarks.md). ``paged_decode`` in ``streamkv/ops/csrc``
walks each sequence's block table and reads each K and V row once, straight
from the pool, for all ``G`` query heads of its KV head, accumulating in fp32
(fp32, bf16, or int8 / fp8 rows whose per-row scale is applied to the dot
product and to the softmax weight, so nothing is dequantized into memory).
Measured against the torch path in docs/benchmarks.md ("Speed levers").
A bf16 query on a bf16 cache takes a variant on AVX512-BF16 that multiplies
bf16 pairs with ``vdpbf16ps`` in both products (the softmax weights rounded
to bf16, as the prefill op and torch's bf16 attention round them): 8.2-8.7
-> 6.9-7.3 ms of a batch-32 step ("bf16 decode attention and greedy argmax").

Why one for prefill and chunk rows: a chained turn, or any chunk of a long
prompt, is a few dozen new rows over a long cached context. The torch path
gathers that context per sequence and layer and runs SDPA with a boolean
bottom-right-causal mask, about 60 GFLOP/s on 2 threads; with ten 44-row
chunks over 656 cached tokens, attention was 60% of the bf16 step.
``paged_prefill`` runs one task per (sequence, KV head, tile of query rows):
each 64-key tile is read from the pool once, transposed to ``[D][64]`` fp32,
and serves all ``G`` heads of the tile's rows (scores as broadcast FMAs, no
horizontal sums; online softmax; P.V into register-blocked accumulators);
tiles above the causal diagonal are skipped. Every row with
``query_len > 1`` takes it, including prompts with no cached context:
measured with ``load_tests/bench_chunk_attention.py`` (docs/benchmarks.md,
"Chunk attention"), 4 x 512-token fresh prompts cost less CPU time on the op
than on SDPA's causal flash path (1.4x in fp32, 1.6x in bf16, one thread,
loaded machine), so there is no case left for the torch path to win.

The KV write of an unquantized cache is one C++ copy per token (``write_kv`` in
the op set; the torch path's two ``index_copy_`` calls cost ~20 us a layer at a
few tokens); an fp32 model's bf16 cache gets its rows rounded in the same op,
bit for bit as torch's cast rounds them; an int8 cache's rows are quantized in
the same op, byte for byte as ``kv_layout.quantize`` does (its ~10 torch ops
per tensor and layer cost more than the attention saved at few tokens); fp8
caches keep the torch write (``kv_layout.write_kv``). When the op cannot be built,
the engine never picks this backend (see :func:`cpu_ops_available`).
"""

from __future__ import annotations

import torch

from streamkv.attention.metadata import AttentionMetadata
from streamkv.attention.torch_paged import TorchPagedAttention
from streamkv.ops.cpu_ops import load_cpu_ops

# (query, KV cache) dtype pairs with a kernel instance in csrc/paged_attention.cpp.
_KERNEL_DTYPES = frozenset(
    {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)}
    | {(q, kv) for q in (torch.float32, torch.bfloat16) for kv in (torch.int8, torch.float8_e4m3fn)}
)


# K/V dtypes the op quantizes into an int8 cache itself.
_INT8_WRITE_DTYPES = (torch.float32, torch.bfloat16)


def writes_in_cpp(cache_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the C++ ``write_kv`` writes K/V of ``kv_dtype`` into a cache of ``cache_dtype``.

    The cache's own dtype (a copy), fp32 into bf16 (rounded as torch's cast rounds), and fp32 or bf16 into
    int8 (quantized as ``kv_layout.quantize`` does); not fp8, whose write is torch's.
    """
    if cache_dtype == torch.int8:
        return kv_dtype in _INT8_WRITE_DTYPES
    return cache_dtype == kv_dtype or (cache_dtype, kv_dtype) == (torch.bfloat16, torch.float32)


def cpu_ops_available() -> bool:
    """True when the C++ ops are built (or build now) and load; logs once why not otherwise."""
    return load_cpu_ops() is not None


class CpuPagedAttention(TorchPagedAttention):
    """The torch backend with its decode and prefill / chunk rows on the in-place C++ kernels.

    Raises:
        RuntimeError: (at construction) the C++ ops cannot be built or loaded.
    """

    name = "cpu"

    def __init__(self) -> None:
        ops = load_cpu_ops()
        if ops is None:
            raise RuntimeError("the streamkv CPU ops could not be built; use the torch attention backend")
        self._ops = ops

    def write(self, kv_cache: torch.Tensor, meta: AttentionMetadata, key: torch.Tensor, value: torch.Tensor) -> None:
        """See :meth:`TorchPagedAttention.write`; in C++ for an unquantized cache (K/V's dtype, or bf16 of fp32), int8.

        A bf16 cache of fp32 K/V gets torch's round-to-nearest-even bits; an
        int8 cache gets the bytes ``kv_layout.quantize`` would write (the op
        repeats its fp32 arithmetic); fp8 caches and other layouts take the
        torch path (``write_kv``).

        Raises:
            RuntimeError: a slot outside the pool (the op checks every slot before it writes).
        """
        if (
            key.dtype == value.dtype
            and writes_in_cpp(kv_cache.dtype, key.dtype)
            and key.stride(1) == value.stride(1) == key.shape[2]
            and key.stride(2) == value.stride(2) == 1
        ):
            self._ops.write_kv(kv_cache, key, value, meta.slot_mapping)
            return
        super().write(kv_cache, meta, key, value)

    def prefill(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> None:
        """See :meth:`TorchPagedAttention.prefill`; same contract, on ``paged_prefill`` (K/V read in place).

        Dtype pairs the kernel has no instance for (float16) take the torch path.

        Raises:
            RuntimeError: a bad block table or tensors on a GPU (the op checks).
        """
        if (query.dtype, kv_cache.dtype) not in _KERNEL_DTYPES:
            return super().prefill(out, query, key, value, kv_cache, meta, scale)
        self._ops.paged_prefill(out, query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
        return None

    def decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        meta: AttentionMetadata,
        scale: float,
        cache_key: str,
    ) -> torch.Tensor:
        """See :meth:`TorchPagedAttention.decode`; same contract, no gather.

        Dtype pairs the kernel has no instance for (float16) take the torch path.

        Raises:
            RuntimeError: tensors on a GPU (the op checks).
        """
        if (query.dtype, kv_cache.dtype) not in _KERNEL_DTYPES:
            return super().decode(query, kv_cache, block_tables, seq_lens, max_seq_len, meta, scale, cache_key)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        self._ops.paged_decode(out, query, kv_cache, block_tables, seq_lens.contiguous(), scale)
        return out
