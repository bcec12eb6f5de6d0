"""Quantized and narrowed KV caches (``--kv-cache-dtype``) against the fp32-KV reference.

Error bounds, per KV dtype, on attention outputs of unit-normal Q/K/V
(``head_dim`` 64, SmolLM2's 9 query on 3 KV heads, contexts up to ~300):
max |out - out_fp32| over every element. Measured on this machine, then
given about 2x headroom (``ATTN_ERROR_BOUND``):

    float16   1.2e-3     (11-bit significand)
    bfloat16  8.4e-3     (8-bit significand)
    int8      1.9e-2     (127 levels per row, scale = row max / 127)
    fp8_e4m3  1.1e-1     (3-bit mantissa: up to 1/16 relative error per element)

(the largest of three seeds, decode and mixed steps).

Every pool starts poisoned: plain pools with NaN, quantized ones with 0xFF
bytes (the int8 code -1 with a NaN float32 scale; the fp8 NaN code), so any
read of a slot the step should not touch turns the output NaN.
"""

from __future__ import annotations

import random

import pytest
import torch

from streamkv.attention.backend import AttentionBackend
from streamkv.attention.kv_layout import (
    allocate_kv_cache,
    dequantize,
    gather_slots,
    quantize,
    resolve_kv_format,
    write_kv,
)
from streamkv.attention.metadata import AttentionMetadata
from streamkv.attention.torch_paged import TorchPagedAttention
from streamkv.cache.block_copy import copy_blocks
from streamkv.config import CacheConfig
from streamkv.llm import LLM
from streamkv.metrics import EngineMetrics
from streamkv.model.loader import LoadedModel
from streamkv.runner import kv_bytes_per_block
from streamkv.sampling_params import SamplingParams

KV_DTYPES = ("bfloat16", "float16", "int8", "fp8_e4m3")
QUANTIZED = ("int8", "fp8_e4m3")
ATTN_ERROR_BOUND = {"float16": 3e-3, "bfloat16": 2e-2, "int8": 4e-2, "fp8_e4m3": 2.5e-1}


def poisoned_cache(
    name: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device: str = "cpu"
) -> torch.Tensor:
    fmt = resolve_kv_format(name, torch.float32)
    cache = allocate_kv_cache(fmt, num_blocks, block_size, num_kv_heads, head_dim, device)
    if fmt.quantized:
        cache.view(torch.uint8).fill_(0xFF)
    else:
        cache.fill_(float("nan"))
    return cache


def run_step(
    name: str,
    backend: AttentionBackend,
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int = 9,
    num_kv_heads: int = 3,
    head_dim: int = 64,
    block_size: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention step over shuffled blocks of a poisoned pool; the earlier context written by ``write_kv``.

    Q/K/V are drawn in fp32 on the CPU (the same values for every backend and
    device), then cast to ``dtype`` on ``device``.

    Returns (output ``[T, Hq, D]`` in ``dtype``, the cache after the step).
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 3
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables = []
    for n in need:
        tables.append(blocks[:n])
        blocks = blocks[n:]
    cache = poisoned_cache(name, num_blocks, block_size, num_kv_heads, head_dim, device)
    qs, ks, vs = [], [], []
    for q_len, seq_len, table in zip(query_lens, seq_lens, tables, strict=True):
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        ctx = seq_len - q_len
        if ctx:
            pos = range(ctx)
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in pos], device=device)
            write_kv(cache, slots, k[:ctx], v[:ctx])
        qs.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype).to(device))
        ks.append(k[ctx:])
        vs.append(v[ctx:])
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, torch.device(device))
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, head_dim**-0.5)
    return out, cache


DECODE = ([1] * 6, [1, 15, 16, 17, 130, 300])
MIXED = ([1, 40, 1, 25, 1], [200, 40, 33, 90, 1])  # decodes, a full prefill, a chunk over cached context


# --- the format ------------------------------------------------------------


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantize_round_trip_error_is_bounded_per_row(name: str) -> None:
    fmt = resolve_kv_format(name, torch.float32)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]  # rows of very different sizes
    back = dequantize(quantize(x, fmt.storage), fmt.storage, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    rel = ((back - x).abs() / amax).max()
    assert rel <= (0.5 / 127 + 1e-6 if name == "int8" else 1 / 16), rel  # half a step; fp8: 3 mantissa bits
    zero = torch.zeros(2, 3, 64)
    assert torch.equal(dequantize(quantize(zero, fmt.storage), fmt.storage, torch.float32), zero)


def test_bytes_per_token_count_the_scales() -> None:
    for name, row_bytes in [("float32", 256), ("bfloat16", 128), ("float16", 128), ("int8", 68), ("fp8_e4m3", 68)]:
        fmt = resolve_kv_format(name, torch.float32)
        assert fmt.bytes_per_token(num_layers=30, num_kv_heads=3, head_dim=64) == 2 * 30 * 3 * row_bytes
    assert resolve_kv_format("auto", torch.bfloat16).name == "bfloat16"
    assert resolve_kv_format("auto", torch.float32).name == "float32"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_format("int4", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="head_dim divisible by 4"):
        allocate_kv_cache(resolve_kv_format("int8", torch.float32), 2, 16, 1, 18)


@pytest.mark.parametrize("name", ("float32", *KV_DTYPES))
def test_copy_blocks_moves_codes_and_scales_bitwise(name: str) -> None:
    fmt = resolve_kv_format(name, torch.float32)
    dev = [allocate_kv_cache(fmt, 6, 4, 2, 8) for _ in range(2)]
    host = [allocate_kv_cache(fmt, 3, 4, 2, 8) for _ in range(2)]
    for layer in dev:
        write_kv(layer, torch.arange(24), torch.randn(24, 2, 8), torch.randn(24, 2, 8))
    before = [t.clone() for t in dev]
    dev_tier, host_tier = [[t] for t in dev], [[t] for t in host]
    copy_blocks(dev_tier, host_tier, [4, 1], [0, 2])  # swap out
    copy_blocks(host_tier, dev_tier, [0, 2], [5, 0])  # swap in elsewhere
    copy_blocks(dev_tier, dev_tier, [3], [2])  # copy-on-write
    for b, a in zip(before, dev, strict=True):
        bb, ab = b.view(torch.uint8), a.view(torch.uint8)
        assert torch.equal(ab[:, 5], bb[:, 4]) and torch.equal(ab[:, 0], bb[:, 1]) and torch.equal(ab[:, 2], bb[:, 3])
    with pytest.raises(ValueError):
        copy_blocks(dev_tier, host_tier, [1, 2], [0])


# --- attention against the fp32-KV reference --------------------------------


@pytest.mark.parametrize("name", KV_DTYPES)
@pytest.mark.parametrize("step", [DECODE, MIXED], ids=["decode", "mixed"])
def test_attention_error_against_fp32_kv_within_bound(name: str, step: tuple[list[int], list[int]]) -> None:
    ref, _ = run_step("float32", TorchPagedAttention(), *step)
    out, cache = run_step(name, TorchPagedAttention(), *step)
    assert not out.isnan().any()
    err = float((out - ref).abs().max())
    assert err <= ATTN_ERROR_BOUND[name], f"{name}: max error {err:.2e}"
    assert err > 0  # the narrower storage is really used


@pytest.mark.parametrize("name", QUANTIZED)
def test_unwritten_slots_stay_poisoned(name: str) -> None:
    out, cache = run_step(name, TorchPagedAttention(), [1, 5], [6, 5], block_size=4, seed=3)
    assert not out.isnan().any()
    all_slots = gather_slots(cache, torch.arange(cache.shape[1] * cache.shape[2]), torch.float32)
    written = ~all_slots.isnan().any(-1).any(-1).any(0)  # [num_slots]
    assert int(written.sum()) == 6 + 5  # exactly the tokens of both sequences, nothing else


@pytest.mark.parametrize("name", ("bfloat16", *QUANTIZED))
@pytest.mark.parametrize("step", [DECODE, MIXED], ids=["decode", "mixed"])
def test_cpu_op_matches_the_torch_path_on_the_same_pool(name: str, step: tuple[list[int], list[int]]) -> None:
    cpu_paged = pytest.importorskip("streamkv.attention.cpu_paged")
    if not cpu_paged.cpu_ops_available():
        pytest.skip("the streamkv C++ CPU ops cannot be built here")
    for head_dim in (64, 16):  # the AVX-512 kernel and the portable one
        ref, ref_cache = run_step(name, TorchPagedAttention(), *step, head_dim=head_dim)
        out, cache = run_step(name, cpu_paged.CpuPagedAttention(), *step, head_dim=head_dim)
        assert not out.isnan().any()
        if name == "int8" and head_dim == 64:
            # The VNNI kernel rounds the query and the softmax weights to int16 (tests/attention/test_cpu_paged.py
            # bounds that against the int8 storage's own error); elsewhere the same fp32 arithmetic as torch.
            torch.testing.assert_close(out, ref, atol=3e-4, rtol=0)
        else:
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
        # the step's own K/V rows: the C++ write (int8: quantized in C++) gives torch's bytes
        assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))


# --- the engine --------------------------------------------------------------


def test_pool_capacity_doubles_and_nearly_quadruples_by_bytes(tiny: LoadedModel) -> None:
    budget = 4 << 20
    blocks = {}
    for name in ("float32", *KV_DTYPES):
        llm = LLM(loaded=tiny, device="cpu", kv_cache_memory=budget, kv_cache_dtype=name, swap_space=0)
        blocks[name] = llm.core.num_blocks
        assert llm.core.num_blocks == budget // kv_bytes_per_block(tiny, 16, name)
        layer = llm.core.runner.kv_caches[0]
        assert layer.shape[1] == llm.core.num_blocks
        assert len(llm.core.runner.kv_caches) * layer.numel() * layer.element_size() <= budget
    m = tiny.model
    assert blocks["bfloat16"] == blocks["float16"] == 2 * blocks["float32"]
    # 8-bit rows carry a float32 scale: (4 * D) / (D + 4) times the fp32 tokens, 3.2x at the tiny model's D = 16
    ratio = blocks["int8"] / blocks["float32"]
    assert abs(ratio - 4 * m.head_dim / (m.head_dim + 4)) < 0.01
    assert blocks["fp8_e4m3"] == blocks["int8"]


@pytest.mark.parametrize("name", KV_DTYPES)
def test_greedy_does_not_change_with_chunk_size_or_prefix_hits(tiny: LoadedModel, name: str) -> None:
    prompts = [[(7 * i + j) % 900 + 10 for j in range(n)] for i, n in enumerate((45, 20, 33))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    whole = LLM(loaded=tiny, device="cpu", num_blocks=64, kv_cache_dtype=name)
    want = [o.outputs[0].token_ids for o in whole.generate(prompts, params)]
    chunked = LLM(loaded=tiny, device="cpu", num_blocks=64, kv_cache_dtype=name, max_num_batched_tokens=8)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == want
    # Again on the same engine: the prompts' full blocks now come from the prefix cache.
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == want
    whole.core.check_invariants()


def test_stats_and_metrics_name_the_kv_dtype(tiny: LoadedModel) -> None:
    llm = LLM(loaded=tiny, device="cpu", num_blocks=32, kv_cache_dtype="int8")
    snap = llm.core.snapshot()
    m = tiny.model
    per_token = 2 * m.num_layers * m.num_kv_heads * (m.head_dim + 4)
    assert snap["kv_cache"] == {"dtype": "int8", "bytes_per_token": per_token}
    metrics = EngineMetrics()
    metrics.attach(lambda: snap)
    body = metrics.render()[0].decode()
    assert 'streamkv_kv_cache_info{dtype="int8"} 1.0' in body
    assert f"streamkv_kv_cache_bytes_per_token {float(snap['kv_cache']['bytes_per_token'])}" in body


def test_cli_flag_reaches_the_cache_config() -> None:
    from streamkv.server.cli import build_configs, build_parser

    engine, _ = build_configs(build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e4m3"]))
    assert engine.cache.kv_cache_dtype == "fp8_e4m3"
    engine, _ = build_configs(build_parser().parse_args(["serve"]))
    assert engine.cache.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])
