"""CpuPagedAttention (the C++ in-place decode and prefill ops) against the torch reference and the dense oracle.

Every pool starts NaN-poisoned (see ``run_case``): a read of any slot the
kernel should not touch (padding of a block table, the unwritten tail of a
partial block, another sequence's blocks) turns the output NaN.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings

from streamkv.attention.kv_layout import gather_slots, quantize, write_kv
from streamkv.attention.metadata import AttentionMetadata
from streamkv.attention.torch_paged import TorchPagedAttention
from streamkv.llm import LLM
from streamkv.model.loader import LoadedModel
from streamkv.ops import cpu_ops
from streamkv.sampling_params import SamplingParams
from tests.attention.test_torch_paged import Case, cases, run_case
from tests.test_kv_quant import poisoned_cache, run_step

cpu_paged = pytest.importorskip("streamkv.attention.cpu_paged")
if not cpu_paged.cpu_ops_available():
    pytest.skip("the streamkv C++ CPU ops cannot be built here", allow_module_level=True)


def compare(case: Case, dtype: torch.dtype = torch.float32, head_dim: int = 8) -> None:
    """The C++ backend matches the torch reference (same pool, same step) and the float64 oracle."""
    ours, oracle, cache_ours = run_case(case, dtype, cpu_paged.CpuPagedAttention(), head_dim)
    ref, _, cache_ref = run_case(case, dtype, TorchPagedAttention(), head_dim)
    assert ours.dtype == dtype and ours.shape == ref.shape
    assert not ours.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours.double(), oracle, atol=tol, rtol=0)
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=0)
    torch.testing.assert_close(cache_ours, cache_ref, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(3, 3), (9, 3), (8, 2)])
def test_pure_decode_partial_blocks_and_gqa(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    seq_lens = [1, 7, 16, 17, 33, 5]  # one token, mid-block, block edges, past an edge
    compare(Case([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, 8, 20, "shuffled", seed=2), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32)])
def test_vectorised_head_dims_long_context(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    # SmolLM2 (9 on 3 heads, head_dim 64) and Llama-style 128 take the AVX-512 kernel, 32 the portable
    # one; contexts up to ~700 in 16-token blocks, lengths off every multiple of 16 (masked lanes).
    seq_lens = [700, 129, 1, 400, 16, 47]
    num_blocks = sum(-(-s // 16) for s in seq_lens) + 4
    case = Case([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, 16, num_blocks, "reversed", seed=11)
    compare(case, dtype, head_dim=head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_decode_rows_take_the_kernel(dtype: torch.dtype) -> None:
    # Decodes first (contiguous run) and decodes scattered between chunks (indexed run).
    compare(Case([1, 5, 9, 1, 13, 1], [21, 12, 9, 16, 13, 1], 6, 2, 4, 40, "shuffled", seed=1), dtype)
    compare(Case([3, 1, 4, 1, 1], [10, 9, 4, 30, 2], 4, 2, 4, 30, "shuffled", seed=5), dtype)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "tables", "head_dim", "scale", "atol", "seed"),
    [
        ([1, 1], [5, 20], [[3, 0], [1, 2]], 8, 0.3, 1e-6, 0),  # decode rows
        ([3, 1, 5], [20, 5, 5], [[3, 0], [1], [2]], 64, 0.125, 1e-5, 1),  # chunk rows (and one decode)
    ],
    ids=["decode", "chunk"],
)
def test_query_with_strides_of_the_fused_qkv(
    query_lens: list[int], seq_lens: list[int], tables: list[list[int]], head_dim: int, scale: float,
    atol: float, seed: int,
) -> None:  # fmt: skip
    # The model hands over q as a view of the fused [T, Hq + Hkv, D] RoPE output.
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, 16)
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(query_lens)
    kv = torch.randn(2, 4, 16, 2, head_dim, generator=gen)
    qk = torch.randn(num_tokens, 6, head_dim, generator=gen)
    q, k, v = qk[:, :4], qk[:, 4:], torch.randn(num_tokens, 2, head_dim, generator=gen)
    ours = cpu_paged.CpuPagedAttention().forward(q, k, v, kv.clone(), meta, scale)
    ref = TorchPagedAttention().forward(q.contiguous(), k.contiguous(), v, kv.clone(), meta, scale)
    torch.testing.assert_close(ours, ref, atol=atol, rtol=0)


def test_kernel_rejects_bad_inputs_clearly() -> None:
    ops = cpu_paged.load_cpu_ops()
    kv = torch.zeros(2, 2, 4, 1, 8)
    q = torch.zeros(1, 2, 8)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_decode(torch.empty_like(q), q, kv, tables.long(), lens, 1.0)
    with pytest.raises(RuntimeError, match="head_dim"):
        ops.paged_decode(torch.empty(1, 2, 4), q[..., :4], kv, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        ops.paged_decode(torch.empty(1, 3, 8), torch.zeros(1, 3, 8), torch.zeros(2, 2, 4, 2, 8), tables, lens, 1.0)


@pytest.mark.parametrize("head_dim", [8, 64])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(case=cases())
def test_random_batches_match_reference(case: Case, head_dim: int) -> None:
    compare(case, head_dim=head_dim)


# --- prefill and chunk rows (paged_prefill) -----------------------------------

PREFILL_DTYPES = [  # (KV cache dtype name, query dtype, tolerance against the torch path)
    ("float32", torch.float32, 1e-5),
    ("bfloat16", torch.bfloat16, 3e-2),
    ("bfloat16", torch.float32, 1e-5),
    ("int8", torch.float32, 1e-5),
    ("fp8_e4m3", torch.float32, 1e-5),
    ("int8", torch.bfloat16, 3e-2),
]
# bf16 query on bf16 KV runs on AMX tiles where the CPU has them (prefill_amx), else on vdpbf16ps
# (prefill_avx512): the bf16 case runs on each kernel, the AMX one only where it can run.
AMX_PREFILL = bool(cpu_paged.load_cpu_ops().amx())
PREFILL_KERNELS = [
    (*dtypes, amx)
    for dtypes in PREFILL_DTYPES
    for amx in ((False, True) if dtypes[:2] == ("bfloat16", torch.bfloat16) else (False,))
]
NEEDS_AMX = "bf16 attention on AMX tiles needs a CPU with AMX-BF16 (and the OS's grant)"


@contextmanager
def amx_kernels(on: bool) -> Iterator[None]:
    """Every extension's bf16 kernels on AMX tiles (``on``) or on vdpbf16ps, for the ``with`` block."""
    if on and not AMX_PREFILL:
        pytest.skip(NEEDS_AMX)
    before = cpu_ops.set_amx(on)
    try:
        yield
    finally:
        cpu_ops.set_amx(before)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's thread count (the C++ ops' too) set to ``n`` for the ``with`` block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


INT8_DECODE_TOL = 3e-4  # fp32 queries on the VNNI int8 decode kernel (int16 query and weights), against torch


def compare_step(
    name: str, dtype: torch.dtype, tol: float, query_lens: list[int], seq_lens: list[int], **shape: int
) -> None:
    """Both backends on the same poisoned pool (``run_step``: shuffled blocks, 0xFF / NaN in every unowned slot)."""
    ref, ref_cache = run_step(name, TorchPagedAttention(), query_lens, seq_lens, dtype=dtype, **shape)
    out, cache = run_step(name, cpu_paged.CpuPagedAttention(), query_lens, seq_lens, dtype=dtype, **shape)
    assert out.dtype == dtype and out.shape == ref.shape
    assert not out.isnan().any()
    # Decode rows on an int8 cache with a vectorised head dim take the VNNI kernel, which rounds the query and
    # the softmax weights to int16 (bounded in test_int8_decode_error_is_a_small_part_of_the_int8_storage_error).
    vnni = name == "int8" and out.shape[-1] in (64, 128)
    row_tol = torch.tensor(
        [max(tol, INT8_DECODE_TOL) if vnni and n == 1 else tol for n in query_lens for _ in range(n)]
    )
    assert ((out.float() - ref.float()).abs().amax((1, 2)) <= row_tol).all()
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))


def random_rows(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Random K/V rows ``[..., head_dim]`` as a pool of ``dtype`` stores them: fp32 / bf16 values, or for an int8
    pool each row's codes then its float32 scale (``kv_layout.quantize``)."""
    x = torch.randn(*shape, generator=gen)
    return quantize(x, torch.int8).view(torch.int8) if dtype == torch.int8 else x.to(dtype)


def poisoned_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A ``[2, num_blocks, block_size, Hkv, head_dim]`` pool that reads NaN wherever nothing was written (an int8
    row of 0xFF bytes has a NaN scale)."""
    if dtype == torch.int8:
        return torch.full((*shape[:-1], shape[-1] + 4), -1, dtype=torch.int8)
    return torch.full(shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("name, dtype, tol", PREFILL_DTYPES)
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_decode_rows_every_dtype_and_block_size(name: str, dtype: torch.dtype, tol: float, block_size: int) -> None:
    # The AVX-512 decode kernel scores keys in runs of up to 16 within a block and prefetches two blocks
    # ahead: blocks smaller and larger than a run, lengths on, before and past block edges, one-token contexts.
    seq_lens = [1, 3, 4, 5, 15, 16, 17, 31, 32, 33, 64, 130, 200, 300, 600]  # past 256: partitions (AVX2)
    compare_step(name, dtype, tol, [1] * len(seq_lens), seq_lens, block_size=block_size, seed=block_size)


@pytest.mark.parametrize("name, dtype, tol", PREFILL_DTYPES)
@pytest.mark.parametrize("seq_lens", [[257], [600], [1000], [600, 3]])
def test_long_sequences_alone_match_the_reference(
    name: str, dtype: torch.dtype, tol: float, seq_lens: list[int]
) -> None:
    # On 2 threads the AVX2 kernel reads a sequence past 256 tokens as partitions merged at the end: 2 or 3 of
    # them take one task per KV head each, 4 and more (or a second sequence) one task per partition.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        compare_step(name, dtype, tol, [1] * len(seq_lens), seq_lens, seed=len(seq_lens))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name, dtype, tol", PREFILL_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (4, 2), (9, 3), (8, 2), (10, 2), (8, 1)])
def test_decode_every_query_group_size(
    name: str, dtype: torch.dtype, tol: float, head_dim: int, num_heads: int, num_kv_heads: int
) -> None:
    # The decode kernels take the group size G as a constant where G * head_dim / 16 <= 16 (G 1-4 at 64, 1-2 at
    # 128) and read it at run time otherwise (5 and 8 here); each thread asks for the rows of its next tasks
    # while it works, across sequences of every length.
    seq_lens = [1, 17, 200, 5, 64, 33, 130, 2]
    shape = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    compare_step(name, dtype, tol, [1] * len(seq_lens), seq_lens, seed=num_heads, **shape)


@pytest.mark.parametrize(
    "kv_dtype, q_dtype, amx",
    [
        (torch.float32, torch.float32, False),
        (torch.bfloat16, torch.float32, False),
        (torch.bfloat16, torch.bfloat16, False),
        (torch.bfloat16, torch.bfloat16, True),  # pass 1 on AMX tiles
        (torch.int8, torch.float32, False),
        (torch.int8, torch.bfloat16, False),
    ],
)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (4, 4), (4, 2), (8, 2), (8, 1), (12, 12)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_of_a_batch_equals_each_sequence_alone(
    kv_dtype: torch.dtype,
    q_dtype: torch.dtype,
    amx: bool,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
) -> None:
    # The AVX2 kernel, the AVX-512 bf16 kernel under a bf16 query and the VNNI int8 kernel (block sizes 16 and 32)
    # give a task a whole sequence (all its KV heads) when the batch has 2 tasks a thread, and one KV head
    # otherwise; a sequence alone takes the second split, the batch the first (the AVX2 kernel past 256 tokens in
    # partitions, in both). Both must give the same bits, or greedy output would change with the batch mix.
    # Shuffled blocks of a NaN-poisoned pool.
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    seq_lens = [1, 17, 200, 5, 64, 33, 130, 2, 16, 47, 700, 256, 257, 513]
    need = [-(-n // block_size) for n in seq_lens]
    cache = poisoned_pool((2, sum(need) + 2, block_size, num_kv_heads, head_dim), kv_dtype)
    order = torch.randperm(cache.shape[1], generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    for b, (n, blocks) in enumerate(zip(seq_lens, need, strict=True)):
        tables[b, :blocks] = torch.tensor(order[:blocks], dtype=torch.int32)
        order = order[blocks:]
        # the tail of a block stays NaN
        slots = tables[b, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
        cache.view(2, -1, num_kv_heads, cache.shape[-1])[:, slots] = random_rows(
            gen, 2, n, num_kv_heads, head_dim, dtype=kv_dtype
        )
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(q_dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ops = cpu_paged.load_cpu_ops()
    batch = torch.empty_like(query)
    with amx_kernels(amx), torch_threads(2):  # the batch splits by sequence, a sequence alone by KV head
        ops.paged_decode(batch, query, cache, tables, lens, head_dim**-0.5)
        assert not batch.isnan().any()
        for b in range(len(seq_lens)):
            alone = torch.empty_like(query[b : b + 1])
            ops.paged_decode(alone, query[b : b + 1], cache, tables[b : b + 1], lens[b : b + 1], head_dim**-0.5)
            assert torch.equal(alone, batch[b : b + 1]), f"sequence {b} (length {seq_lens[b]})"


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "seq_lens",
    [
        [700],
        [700, 3, 5],  # one task per KV head: the first sequence's three outweigh the rest
        [3, 5, 9, 700],
        [900, 40, 40, 40, 40, 40, 40, 40],  # a task per sequence: one holds most of the tokens
        [40, 40, 40, 40, 40, 40, 40, 900],
        [64] * 8,
        [1, 2, 1, 2, 1, 2, 1, 2, 1],
    ],
)
@pytest.mark.parametrize(
    "dtype, amx", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True), (torch.int8, False)]
)
def test_decode_is_the_same_on_any_number_of_threads(
    seq_lens: list[int], threads: int, dtype: torch.dtype, amx: bool
) -> None:
    # The threads split the tasks by their tokens, not their count: every task must still run exactly once
    # (out starts NaN, so a task left out shows) and give the same bits whichever thread runs it. The thread
    # count also decides whether a task has one KV head or all of them (bf16, int8 on AVX-512 VNNI, or fp32 on
    # AVX2).
    gen = torch.Generator().manual_seed(len(seq_lens) + threads)
    need = [-(-n // 16) for n in seq_lens]
    cache = random_rows(gen, 2, sum(need), 16, 3, 64, dtype=dtype)
    tables = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    order = torch.randperm(sum(need), generator=gen).tolist()
    for b, blocks in enumerate(need):
        tables[b, :blocks] = torch.tensor(order[:blocks], dtype=torch.int32)
        order = order[blocks:]
    query = torch.randn(len(seq_lens), 9, 64, generator=gen).to(torch.bfloat16 if dtype == torch.int8 else dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ops = cpu_paged.load_cpu_ops()
    with amx_kernels(amx):
        with torch_threads(1):
            one = torch.full_like(query, float("nan"))
            ops.paged_decode(one, query, cache, tables, lens, 0.125)
        with torch_threads(threads):
            out = torch.full_like(query, float("nan"))
            ops.paged_decode(out, query, cache, tables, lens, 0.125)
    assert not one.isnan().any()
    assert torch.equal(out, one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
# one task per KV head (batch 1), one per sequence (batch 8): the sequence without keys first, between, last
@pytest.mark.parametrize("batch, empty", [(1, 0), (8, 0), (8, 3), (8, 7)])
def test_decode_of_a_sequence_without_keys_is_nan_and_leaves_the_others_alone(
    batch: int, empty: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(batch)
    cache = random_rows(gen, 2, 2 * batch, 16, 3, 64, dtype=dtype)
    tables = torch.arange(2 * batch, dtype=torch.int32).view(batch, 2)
    lens = torch.full((batch,), 20, dtype=torch.int32)
    lens[empty] = 0
    q_dtype = torch.bfloat16 if dtype == torch.int8 else dtype
    query, out = torch.randn(batch, 9, 64, generator=gen).to(q_dtype), torch.zeros(batch, 9, 64, dtype=q_dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # batch 8 is 4 sequences a thread: one task per sequence
        cpu_paged.load_cpu_ops().paged_decode(out, query, cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(before)
    assert out[empty].isnan().all()  # 0 / 0, as the portable kernel gives
    others = torch.ones(batch, dtype=torch.bool)
    others[empty] = False
    assert not out[others].isnan().any()


@pytest.mark.parametrize("name, dtype, tol, amx", PREFILL_KERNELS)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (4, 4)])  # GQA G = 3 and G = 1
@pytest.mark.parametrize("head_dim", [64, 12])  # the AVX-512 kernel and the portable one
def test_chunks_over_cached_context_match_the_torch_path(
    name: str, dtype: torch.dtype, tol: float, amx: bool, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    # Chunks of 2..70 rows over contexts of 1..~300, crossing block edges, mixed with decode rows.
    query_lens = [2, 1, 70, 17, 1, 33, 5, 44]
    seq_lens = [2, 40, 300, 17, 1, 48, 261, 100]
    shape = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    with amx_kernels(amx):
        compare_step(name, dtype, tol, query_lens, seq_lens, **shape, seed=7)


@pytest.mark.parametrize("name, dtype, tol, amx", PREFILL_KERNELS[:3])
def test_chunk_lengths_and_offsets_across_block_edges(name: str, dtype: torch.dtype, tol: float, amx: bool) -> None:
    # Every chunk length 2..20 at context offsets on, before and after a block edge; small blocks too.
    with amx_kernels(amx):
        for q_len in range(2, 21):
            for ctx in (0, 15, 16, 17, 63):
                compare_step(name, dtype, tol, [q_len, 1], [ctx + q_len, ctx + 1], seed=q_len * 100 + ctx)
        compare_step(name, dtype, tol, [9, 30, 1], [31, 30, 5], block_size=4, seed=3)


@pytest.mark.parametrize("name, dtype, tol, amx", PREFILL_KERNELS[:3])
def test_only_one_sequence_with_a_long_chunk(name: str, dtype: torch.dtype, tol: float, amx: bool) -> None:
    # A single chunk: tiles of query rows keep both threads busy; 128-wide heads (register block of 2; on AMX
    # pairs of 16-vector groups, P . V in four passes of 2 + 2 accumulator tiles).
    with amx_kernels(amx):
        compare_step(name, dtype, tol, [64], [700], num_heads=8, num_kv_heads=2, head_dim=128)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [(64, 9, 3), (128, 8, 2), (64, 4, 4)])
def test_bf16_prefill_rows_are_the_same_in_any_batch(
    amx: bool, head_dim: int, num_heads: int, num_kv_heads: int
) -> None:
    # A prompt's rows alone, as the first rows of a longer chunk's batch and as a shorter prefix beside other
    # sequences: the same bits (the task split and the 16-vector tile groups differ), or greedy output would
    # change with the batch mix. Shuffled blocks of a NaN-poisoned pool. 1,100 tokens cross two of the AMX
    # kernel's 512-key softmax blocks' edges, so the running max and sum carry over twice; a chunk at 37 splits
    # its rows into other tasks than the whole prompt, and one thread takes other tile sizes than two.
    gen = torch.Generator().manual_seed(head_dim)
    lens = [1100, 7, 1100, 40]
    need = [-(-n // 16) for n in lens]
    cache = torch.full((2, sum(need) + 2, 16, num_kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    order = torch.randperm(cache.shape[1], generator=gen).tolist()
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for b, blocks in enumerate(need):
        tables[b, :blocks] = torch.tensor(order[:blocks], dtype=torch.int32)
        order = order[blocks:]
    tables[2] = tables[0]  # sequence 2 reads sequence 0's blocks: the same keys
    for b in (0, 1, 3):
        slots = tables[b, torch.arange(lens[b]) // 16].long() * 16 + torch.arange(lens[b]) % 16
        cache.view(2, -1, num_kv_heads, head_dim)[:, slots] = torch.randn(
            2, lens[b], num_kv_heads, head_dim, generator=gen
        ).bfloat16()
    q0 = torch.randn(1100, num_heads, head_dim, generator=gen).bfloat16()
    other = torch.randn(7 + 40, num_heads, head_dim, generator=gen).bfloat16()
    ops = cpu_paged.load_cpu_ops()
    scale = head_dim**-0.5

    def prefill(query: torch.Tensor, rows: list[int], seq_lens: list[int], table: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(query)
        starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
        ops.paged_prefill(out, query, cache, table, torch.tensor(seq_lens, dtype=torch.int32), starts, scale)
        return out

    with amx_kernels(amx):
        alone = prefill(q0, [1100], [1100], tables[:1])
        assert not alone.isnan().any()
        batch = prefill(torch.cat([q0, other[:7], q0[:93], other[7:]]), [1100, 7, 93, 40], [1100, 7, 93, 40], tables)
        assert torch.equal(batch[:1100], alone)
        assert torch.equal(batch[1107:1200], alone[:93])  # a prompt of 93 tokens: the same rows
        chunk = prefill(q0[37:], [1063], [1100], tables[:1])  # the last 1,063 rows as a chunk over 37 cached tokens
        assert torch.equal(chunk, alone[37:])
        for start in (511, 512, 1025):  # chunks that start at and past the block edges
            tail = prefill(q0[start:], [1100 - start], [1100], tables[:1])
            assert torch.equal(tail, alone[start:])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(prefill(q0, [1100], [1100], tables[:1]), alone)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.skipif(not AMX_PREFILL, reason=NEEDS_AMX)
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [(64, 9, 3), (128, 8, 2)])
def test_amx_prefill_rows_are_the_same_with_their_context_split_by_keys(
    threads: int, head_dim: int, num_heads: int, num_kv_heads: int
) -> None:
    # Past 2,048 keys the AMX kernel restarts a row's softmax at every partition edge (2,048, 4,096) and merges the
    # partitions' partials in order, whether one task reads them all or a short chunk's context is split by its keys
    # across tasks: a row's bits must not depend on which, or a follow-up turn would differ from its prompt
    # recomputed. 4,500 tokens are three partitions. A chunk of 30 rows over them is split by keys on 2 and 4 threads
    # (its tiles of rows would each read the whole context), not on one; 100 and 256 rows where make_tasks' finish
    # times say so; 300 rows never. Chunks of 100 rows across the edges at 2,048 and 4,096 (rows that see none of the
    # last partition). Shuffled blocks of a NaN-poisoned pool; the rows also against float64 attention.
    gen = torch.Generator().manual_seed(head_dim + threads)
    n = 4500
    blocks = -(-n // 16)
    cache = torch.full((2, blocks + 3, 16, num_kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    table = torch.randperm(blocks + 3, generator=gen)[:blocks].to(torch.int32)[None]
    slots = table[0, torch.arange(n) // 16].long() * 16 + torch.arange(n) % 16
    kv = torch.randn(2, n, num_kv_heads, head_dim, generator=gen).bfloat16()
    cache.view(2, -1, num_kv_heads, head_dim)[:, slots] = kv
    q = torch.randn(n, num_heads, head_dim, generator=gen).bfloat16()
    ops = cpu_paged.load_cpu_ops()
    scale = head_dim**-0.5

    def prefill(query: torch.Tensor, rows: list[int], seq_lens: list[int]) -> torch.Tensor:
        out = torch.empty_like(query)
        starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
        tables = table.expand(len(rows), -1).contiguous()
        ops.paged_prefill(out, query, cache, tables, torch.tensor(seq_lens, dtype=torch.int32), starts, scale)
        return out

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with amx_kernels(True):
            alone = prefill(q, [n], [n])
            for rows in (30, 100, 256, 300):
                assert torch.equal(prefill(q[n - rows :], [rows], [n]), alone[n - rows :])
            for end in (2100, 4150):
                assert torch.equal(prefill(q[end - 100 : end], [100], [end]), alone[end - 100 : end])
            both = prefill(torch.cat([q[n - 30 :], q[:50]]), [30, 50], [n, 50])  # beside another sequence's prompt
            assert torch.equal(both[:30], alone[n - 30 :]) and torch.equal(both[30:], alone[:50])
    finally:
        torch.set_num_threads(before)
    group = num_heads // num_kv_heads
    keys, values = (x.double().repeat_interleave(group, 1) for x in kv)
    rows = torch.tensor([100, 2047, 2048, 3000, 4095, 4096, n - 1])  # either side of each partition edge
    scores = torch.einsum("rhd,khd->hrk", q[rows].double(), keys) * scale
    scores.masked_fill_(torch.arange(n)[None, None, :] > rows[None, :, None], float("-inf"))
    ref = torch.einsum("hrk,khd->rhd", scores.softmax(-1), values)
    # Per (row, head), relative to the output's size (bf16 rounds the output and the weights; a partition left out or
    # weighed wrongly is an error of order 1).
    error = (alone[rows].double() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(error.max()) < 1e-2


@pytest.mark.parametrize("amx", [False, True])
def test_bf16_prefill_with_a_negative_scale_matches_the_torch_path(amx: bool) -> None:
    # The AMX kernel takes the block max over the raw scores, which is the scaled max only for scale > 0;
    # paged_prefill sends any other scale to the vdpbf16ps kernel. Sharp scores (the query times 12) over
    # 700 keys would otherwise overflow e^x.
    gen = torch.Generator().manual_seed(11)
    n, heads, kv_heads, dim = 700, 9, 3, 64
    blocks = -(-n // 16)
    cache = torch.randn(2, blocks, 16, kv_heads, dim, generator=gen).bfloat16()
    table = torch.arange(blocks, dtype=torch.int32)[None]
    query = (12 * torch.randn(n, heads, dim, generator=gen)).bfloat16()
    lens, starts = torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
    scale = -(dim**-0.5)
    out = torch.empty_like(query)
    with amx_kernels(amx):
        cpu_paged.load_cpu_ops().paged_prefill(out, query, cache, table, lens, starts, scale)
    keys = cache[0].reshape(-1, kv_heads, dim)[:n].float().repeat_interleave(heads // kv_heads, 1)
    values = cache[1].reshape(-1, kv_heads, dim)[:n].float().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    scores.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    assert out.isfinite().all()
    assert float((out.float() - ref).abs().max()) < 3e-2


@pytest.mark.skipif(not AMX_PREFILL, reason=NEEDS_AMX)
def test_amx_prefill_runs_its_own_kernel() -> None:
    # The AMX cases above would pass on the vdpbf16ps kernel too: the two sum q . k in different orders, so
    # some last bits of the output differ, and both stay within the tests' bounds.
    step = ([100, 33], [100, 233])
    outs = []
    for amx in (True, False):
        with amx_kernels(amx):
            outs.append(run_step("bfloat16", cpu_paged.CpuPagedAttention(), *step, dtype=torch.bfloat16, seed=9)[0])
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.skipif(not AMX_PREFILL, reason=NEEDS_AMX)
@pytest.mark.parametrize("batch", [1, 8])  # one task per KV head; one per sequence
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 2, 128), (8, 1, 64)])
def test_amx_decode_runs_its_own_kernel(batch: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    # On random rows the two kernels rarely differ in a bf16 output bit, so these keys make the order of q . k's
    # sum show: dims 0 and 32 hold 2^30 and -2^30, dim 2 holds p % 7, the query is all ones. vdpbf16ps keeps dims
    # 0 and 32 in one lane and dim 2 in another, so the lanes' sum is p % 7; the tiles add the dim pairs in order,
    # so 2^30 swallows p % 7 before -2^30 cancels it, every score is 0 and the output is the mean of V.
    # Group 3 at head_dim 64 is a template constant of both kernels (batch 8: one task per sequence); group 4 at
    # head_dim 128 and group 8 are a run-time bound, one task per KV head in any batch.
    length = 40
    cache = torch.zeros(2, 3 * batch, 16, num_kv_heads, head_dim)
    tables = torch.arange(3 * batch, dtype=torch.int32).view(batch, 3)
    slots = tables[:, torch.arange(length) // 16].long() * 16 + torch.arange(length) % 16  # [batch, length]
    rows = cache.view(2, -1, num_kv_heads, head_dim)
    rows[0, :, :, 0], rows[0, :, :, 32] = 2.0**30, -(2.0**30)
    rows[0, slots, :, 2] = (torch.arange(length) % 7).float()[:, None]
    rows[1, slots] = (torch.arange(length) % 5).float()[:, None, None]
    cache = cache.to(torch.bfloat16)
    query = torch.ones(batch, num_heads, head_dim, dtype=torch.bfloat16)
    lens = torch.full((batch,), length, dtype=torch.int32)
    ops = cpu_paged.load_cpu_ops()
    outs = []
    for amx in (True, False):
        with amx_kernels(amx), torch_threads(2):
            out = torch.empty_like(query)
            ops.paged_decode(out, query, cache, tables, lens, 0.125)
            outs.append(out)
    assert torch.equal(outs[0], torch.full_like(query, 2.0))  # the mean of p % 5 over 40 keys
    assert float(outs[1].float().min()) > 2.0  # weighted towards the keys with the largest p % 7


def test_prefill_op_rejects_bad_inputs_clearly() -> None:
    ops = cpu_paged.load_cpu_ops()
    kv = torch.zeros(2, 4, 4, 1, 8)
    q = torch.zeros(3, 2, 8)
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    starts = torch.tensor([0, 3], dtype=torch.int32)
    ops.paged_prefill(torch.empty_like(q), q, kv, tables, lens, starts, 1.0)  # the valid call
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_prefill(torch.empty_like(q), q, kv, tables, lens, starts.long(), 1.0)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.paged_prefill(torch.empty_like(q), q, kv, tables + 3, lens, starts, 1.0)
    with pytest.raises(RuntimeError, match="too short"):
        ops.paged_prefill(torch.empty_like(q), q, kv, tables, torch.tensor([9], dtype=torch.int32), starts, 1.0)
    with pytest.raises(RuntimeError, match="query length"):
        ops.paged_prefill(torch.empty_like(q), q, kv, tables, torch.tensor([2], dtype=torch.int32), starts, 1.0)
    with pytest.raises(RuntimeError, match="0 to T"):
        ops.paged_prefill(torch.empty_like(q), q, kv, tables, lens, torch.tensor([0, 2], dtype=torch.int32), 1.0)


def test_engine_greedy_equal_on_both_backends_over_chunks_and_prefix_hits(tiny: LoadedModel) -> None:
    # Two prompts share 40 tokens (full blocks, cached after the first pass); a 16-token budget splits
    # every prompt into chunks over cached context, mixed with the other sequences' decodes.
    shared = [100 + (7 * i) % 4000 for i in range(40)]
    prompts = [shared + [300 + i for i in range(n)] for n in (3, 29)] + [[900 + 5 * i for i in range(23)]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs: dict[str, list[list[int]]] = {}
    for backend in ("torch", "cpu"):
        llm = LLM(loaded=tiny, device="cpu", num_blocks=64, max_num_batched_tokens=16, attention_backend=backend)
        assert llm.core.backend.name == backend
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # prefix hits
        assert again == first
        outs[backend] = first
        llm.core.check_invariants()
    assert outs["cpu"] == outs["torch"]


@pytest.mark.parametrize("amx", [False, True])
def test_bf16_prefill_error_no_worse_than_the_torch_bf16_path(amx: bool) -> None:
    # bf16 query on bf16 KV takes vdpbf16ps or AMX tiles with p rounded to bf16: its error against the fp32
    # computation of the same inputs stays that of torch's bf16 attention.
    step = ([44, 1, 64, 30], [700, 90, 64, 300])
    ref, _ = run_step("float32", TorchPagedAttention(), *step, seed=5)
    torch_err = (
        run_step("bfloat16", TorchPagedAttention(), *step, dtype=torch.bfloat16, seed=5)[0].float() - ref
    ).abs()
    with amx_kernels(amx):
        ours = run_step("bfloat16", cpu_paged.CpuPagedAttention(), *step, dtype=torch.bfloat16, seed=5)[0]
    our_err = (ours.float() - ref).abs()
    assert float(our_err.mean()) <= 1.2 * float(torch_err.mean())
    assert float(our_err.max()) <= 1.5 * float(torch_err.max())


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (128, 16), (64, 5), (128, 5), (64, 1), (64, 32)])
def test_bf16_decode_error_no_worse_than_the_torch_bf16_path(head_dim: int, block_size: int, amx: bool) -> None:
    # The decode op's bf16 variant (vdpbf16ps in both products, or q . k on AMX tiles where a block holds whole
    # runs of 16 keys; softmax weights rounded to bf16): odd and even context lengths (the last token pairs with a
    # zero row), a block size that splits token pairs.
    seq_lens = [1, 2, 17, 333, 700, 64, 31]
    step = ([1] * len(seq_lens), seq_lens, 9, 3, head_dim, block_size)
    ref, _ = run_step("float32", TorchPagedAttention(), *step, seed=6)
    torch_err = (
        run_step("bfloat16", TorchPagedAttention(), *step, dtype=torch.bfloat16, seed=6)[0].float() - ref
    ).abs()
    with amx_kernels(amx):
        ours = run_step("bfloat16", cpu_paged.CpuPagedAttention(), *step, dtype=torch.bfloat16, seed=6)[0]
    assert not ours.isnan().any()
    our_err = (ours.float() - ref).abs()
    assert float(our_err.mean()) <= 1.2 * float(torch_err.mean())
    assert float(our_err.max()) <= 1.5 * float(torch_err.max())


@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (128, 16), (64, 5), (128, 5), (64, 1)])
def test_int8_decode_error_is_a_small_part_of_the_int8_storage_error(head_dim: int, block_size: int) -> None:
    # The decode op's int8 variant (VNNI: the query and each softmax weight times its V scale rounded to int16,
    # exact int32 sums, flushed to fp32 every 256 token pairs): odd and even lengths, contexts past one and two
    # flushes, block sizes that split token pairs. Its distance from the torch path on the same int8 pool must be
    # a small part of the distance int8 storage itself puts between that path and fp32 KV.
    seq_lens = [1, 2, 17, 333, 700, 1100, 64, 31]
    step = ([1] * len(seq_lens), seq_lens, 9, 3, head_dim, block_size)
    fp32_kv, _ = run_step("float32", TorchPagedAttention(), *step, seed=7)
    same_pool, _ = run_step("int8", TorchPagedAttention(), *step, seed=7)
    ours, _ = run_step("int8", cpu_paged.CpuPagedAttention(), *step, seed=7)
    assert not ours.isnan().any()
    storage_err = float((same_pool - fp32_kv).abs().max())
    kernel_err = float((ours - same_pool).abs().max())
    assert 0 < kernel_err <= 0.02 * storage_err, (kernel_err, storage_err)
    # bf16 queries: no worse against fp32 KV than the torch path's bf16 attention over the same int8 pool
    torch_bf16 = run_step("int8", TorchPagedAttention(), *step, dtype=torch.bfloat16, seed=7)[0].float()
    ours_bf16 = run_step("int8", cpu_paged.CpuPagedAttention(), *step, dtype=torch.bfloat16, seed=7)[0].float()
    assert not ours_bf16.isnan().any()
    torch_err, our_err = (torch_bf16 - fp32_kv).abs(), (ours_bf16 - fp32_kv).abs()
    assert float(our_err.mean()) <= 1.05 * float(torch_err.mean())
    assert float(our_err.max()) <= 1.2 * float(torch_err.max())


@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_decode_keeps_the_softmax_tail_next_to_a_peak(
    num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    # One key takes ~96% of the softmax; 3,000 others share the rest, each far below 1/65534 of the peak's
    # weight. The int16 weights are scaled per 16-token run, so the tail is kept: against float64 attention over
    # the same dequantized pool the kernel is off by 0.9-2.3e-4 (fp32 queries), where one scale per head lost the
    # whole tail (7-9e-3 here; 1.6e-2 with bf16 queries, against 3.9-5.4e-3 now).
    ops = cpu_paged.load_cpu_ops()
    gen = torch.Generator().manual_seed(11)
    head_dim, block_size, length = 64, 16, 3001
    blocks = -(-length // block_size)
    k = torch.randn(length, num_kv_heads, head_dim, generator=gen) * 0.05
    v = torch.randn(length, num_kv_heads, head_dim, generator=gen) + 1.0  # a tail mean far from 0
    q = torch.randn(1, num_heads, head_dim, generator=gen)
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5
    for h in range(num_kv_heads):  # the peak: key 1500 along its KV head's first query head, score 11.2
        qh = q[0, h * group]
        k[1500, h] = qh * (11.2 / (float(qh @ qh) * scale))
    v[1500] = -3.0
    cache = poisoned_cache("int8", blocks + 2, block_size, num_kv_heads, head_dim)
    table = torch.randperm(blocks + 2, generator=gen)[:blocks].int()
    slots = table.long().repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(blocks)
    write_kv(cache, slots[:length], k, v)
    out = torch.empty(1, num_heads, head_dim, dtype=dtype)
    ops.paged_decode(out, q.to(dtype), cache, table[None], torch.tensor([length], dtype=torch.int32), scale)
    kv = gather_slots(cache, slots[:length], torch.float64)  # [2, L, Hkv, D], the values the cache holds
    kk, vv = kv[0].repeat_interleave(group, 1), kv[1].repeat_interleave(group, 1)
    w = torch.softmax(torch.einsum("hd,lhd->hl", q.to(dtype)[0].double(), kk) * scale, -1)
    ref = torch.einsum("hl,lhd->hd", w, vv)
    assert float(w[0].max()) > 0.9 and float(w[0].sort().values[:-1].sum()) > 0.02  # a peak, and a real tail
    err = float((out[0].double() - ref).abs().max())
    assert err <= (1e-3 if dtype == torch.float32 else 1e-2), err  # measured 0.9-2.3e-4 / 3.9-5.4e-3


def test_int8_decode_keeps_a_nan_v_row_nan() -> None:
    ops = cpu_paged.load_cpu_ops()
    cache = poisoned_cache("int8", 2, 16, 1, 64)
    write_kv(cache, torch.arange(20), torch.randn(20, 1, 64), torch.randn(20, 1, 64))
    rows = cache.view(torch.uint8).view(2, 32, 1, 68)
    rows[1, 7, 0, 64:] = torch.tensor([float("nan")]).view(torch.uint8)  # token 7's V scale
    out = torch.empty(1, 4, 64)
    ops.paged_decode(out, torch.randn(1, 4, 64), cache, torch.tensor([[0, 1]], dtype=torch.int32),
                     torch.tensor([20], dtype=torch.int32), 0.125)  # fmt: skip
    assert out.isnan().all()


def test_int8_write_kv_gives_the_torch_quantizers_bytes() -> None:
    ops = cpu_paged.load_cpu_ops()
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        for head_dim in (64, 20):  # the AVX-512 loop, and its scalar tail
            key = torch.randn(7, 3, head_dim, generator=gen) * torch.logspace(-4, 3, 7)[:, None, None]
            value = torch.randn(7, 3, head_dim, generator=gen)
            key[2, 1] = 0.0  # an all-zero row: scale 0, codes 0
            value[4, 0] = 0.25
            value[4, 0, :5] = torch.tensor([0.5, -0.5, 1.5, 2.5, 127.0])  # scale 1: ties at x / scale
            value[5, 1, 3] = float("nan")  # torch's amax: a NaN scale (the row divided by 1), code 0 for the NaN
            value[6, 2, 0] = float("inf")  # scale inf: finite codes 0, the inf's NaN quotient code 0
            value[6, 0, 1] = float("-inf")
            key, value = key.to(dtype), value.to(dtype)
            slots = torch.tensor([9, 0, 3, 14, 5, 8, 1])
            want = poisoned_cache("int8", 4, 4, 3, head_dim)
            write_kv(want, slots, key, value)
            got = poisoned_cache("int8", 4, 4, 3, head_dim)
            ops.write_kv(got, key, value, slots)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (dtype, head_dim)
            nan_scale = got.view(torch.uint8).view(2, 16, 3, head_dim + 4)[1, slots[5], 1, head_dim:]
            assert nan_scale.view(torch.float32).isnan().all()  # the NaN row stays visibly NaN in the cache
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.write_kv(poisoned_cache("int8", 4, 4, 3, 64), key.half(), value.half(), slots)


@pytest.mark.parametrize(
    "cache, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("bfloat16", torch.float32),
                     ("int8", torch.float32), ("int8", torch.bfloat16)]
)  # fmt: skip
def test_a_prefill_sized_write_split_between_threads_gives_the_torch_bytes(cache: str, dtype: torch.dtype) -> None:
    # 700 tokens (past write_kv's 256-token grain, so both threads write) into shuffled slots of a poisoned pool.
    ops = cpu_paged.load_cpu_ops()
    gen = torch.Generator().manual_seed(11)
    key = torch.randn(700, 3, 64, generator=gen).to(dtype)
    value = torch.randn(700, 3, 64, generator=gen).to(dtype)
    slots = torch.randperm(64 * 16, generator=gen)[:700]
    want = poisoned_cache(cache, 64, 16, 3, 64)
    rows = (key, value) if cache == "int8" else (key.to(want.dtype), value.to(want.dtype))  # torch rounds fp32 -> bf16
    write_kv(want, slots, *rows)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = poisoned_cache(cache, 64, 16, 3, 64)
        ops.write_kv(got, key, value, slots)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_fp32_write_kv_into_a_bf16_cache_rounds_as_torch_casts() -> None:
    # An fp32 model's --kv-cache-dtype bfloat16: the op rounds each value to nearest-even as torch's cast does,
    # in 8-lane runs and a scalar tail (head dim 20), ties, NaN, infinities and values past bf16's range included.
    ops = cpu_paged.load_cpu_ops()
    gen = torch.Generator().manual_seed(4)
    for head_dim in (64, 20):
        key = torch.randn(5, 3, head_dim, generator=gen) * torch.logspace(-30, 30, 5)[:, None, None]
        value = torch.randn(5, 3, head_dim, generator=gen)
        # the bits of halfway cases both ways, the largest float and two subnormals (-0x7FFE8000 is 0x80018000)
        ties = torch.tensor([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00008000, -0x7FFE8000], dtype=torch.int32)
        value[0, 0, :5] = ties.view(torch.float32)
        value[1, 1, 2] = float("nan")
        value[2, 2, 0], value[2, 2, 1] = float("inf"), float("-inf")
        slots = torch.tensor([9, 0, 3, 14, 5])
        want = poisoned_cache("bfloat16", 4, 4, 3, head_dim)
        write_kv(want, slots, key.bfloat16(), value.bfloat16())
        got = poisoned_cache("bfloat16", 4, 4, 3, head_dim)
        ops.write_kv(got, key, value, slots)
        nan = want.isnan()  # torch's vectorised cast makes a NaN 0xFFFF, c10's scalar one 0x7FC0: NaN either way
        assert torch.equal(got.isnan(), nan) and got[1].view(16, 3, head_dim)[slots[1], 1, 2].isnan(), head_dim
        assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]), head_dim
    with pytest.raises(RuntimeError, match="differs from the cache"):
        ops.write_kv(poisoned_cache("float32", 4, 4, 3, 64), key.bfloat16(), value.bfloat16(), slots)


def test_write_kv_refuses_a_slot_outside_the_pool_before_writing_any() -> None:
    ops = cpu_paged.load_cpu_ops()
    kv = torch.zeros(2, 2, 4, 3, 8)  # 8 slots
    key, value = torch.ones(2, 3, 8), torch.full((2, 3, 8), 2.0)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.write_kv(kv, key, value, torch.tensor([1, 8]))
    assert not kv.any()  # the first, valid slot was not written either
    ops.write_kv(kv, key, value, torch.tensor([7, 0]))
    flat = kv.view(2, 8, 3, 8)
    assert (flat[0, [7, 0]] == 1).all() and (flat[1, [7, 0]] == 2).all() and not flat[:, 1:7].any()
