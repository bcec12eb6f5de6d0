"""``--quantization int8``: the int8 small-batch kernel against an exact replica, the layer's dispatch, the engine.

The kernel quantizes each row of ``x`` to int16 (``max|x| / 32767`` per row),
sums the int16 x int8 products exactly (int32 partial sums, added every 256
pairs into a float64 total), rounds the sum to fp32 once and applies both
scales in fp32; on AMX-INT8 its tile path sums the same integers, so the
two paths agree bit for bit. The replica below does the same
quantization with the same float32 operations, so the codes are identical,
and the products are summed in float64: the two agree to fp32 rounding of
the sums. Against the float weights the error is the quantization's, bounded
per output by ``sum_k |x_k| * scale / 2 + sum_k |W_k| * max|x| / 65534``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streamkv.config import ModelConfig
from streamkv.model.linear import Linear, SmallMatmul, dequantize_int8, quantize_int8
from streamkv.model.loader import LoadedModel, from_hf, load_model
from streamkv.model.precision import onednn_has_bf16
from streamkv.ops.cpu_ops import load_linear_ops
from tests.engine_helpers import assert_pool_whole, greedy, make_llm, prompts_of

ops = load_linear_ops()
needs_kernel = pytest.mark.skipif(
    ops is None or not ops.small_linear_int8_supported(), reason="the int8 kernel needs AVX-512 VNNI and a compiler"
)


def replica(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic: x's int16 codes (float32 ops, round half to even) x q, summed in float64."""
    xf = x.float()
    absmax = xf.abs().amax(dim=1)
    inv = torch.where(absmax > 0, torch.tensor(32767.0) / absmax, torch.zeros_like(absmax))
    codes = torch.round(xf * inv[:, None]).clamp(-32767, 32767).double()
    xs = (absmax / 32767.0).double()
    out = (codes @ q.double().T) * xs[:, None] * scale.double()[None, :]
    return out if b is None else out + b.double()


def assert_matches_replica(got: torch.Tensor, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b) -> None:
    want = replica(x, q, s, b)
    assert got.dtype == x.dtype and got.shape == want.shape
    # fp32 sums of magnitude up to sum|x||W|: a few fp32 ulps of it; bf16 output: one bf16 ulp on top.
    scale = (x.double().abs() @ (q.double() * s.double()[:, None]).abs().T) + (0 if b is None else b.double().abs())
    tol = 1e-6 * scale + (want.abs() * 2.0**-8 if x.dtype == torch.bfloat16 else 0)
    assert ((got.double() - want).abs() <= tol + 1e-30).all(), f"max |diff| {(got.double() - want).abs().max()}"


def test_quantize_int8_is_within_half_a_step() -> None:
    w = torch.randn(37, 53)
    w[5] = 0  # an all-zero row: scale 1, codes 0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.abs().max() <= 127
    assert scale[5] == 1 and (q[5] == 0).all()
    assert ((dequantize_int8(q, scale, torch.float32) - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    assert (q.abs().amax(dim=1)[torch.arange(37) != 5] == 127).all()  # each row's largest weight is +-127


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(960, 576), (16, 64), (17, 64), (33, 11), (50, 34), (1, 2), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 17, 64])
def test_kernel_matches_the_replica(dtype: torch.dtype, n: int, k: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=gen)
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    b = torch.randn(n, generator=gen)
    q, s = quantize_int8(w)
    packed = ops.pack_small_linear_int8(q)
    for bias in (None, b):
        out = torch.full((rows, n), float("nan"), dtype=dtype)
        ops.small_linear_int8(out, x, packed, s, bias)
        assert_matches_replica(out, x, q, s, bias)


@needs_kernel
def test_int32_partial_sums_cannot_overflow() -> None:
    # Every product at its largest (32767 * 127) over K = 4096: 17x past int32 unless added to the total every
    # 256 pairs.
    k = 4096
    q = torch.full((16, k), 127, dtype=torch.int8)
    x = torch.ones(2, k)
    out = torch.empty(2, 16)
    ops.small_linear_int8(out, x, ops.pack_small_linear_int8(q), torch.full((16,), 1 / 127), None)
    torch.testing.assert_close(out, torch.full((2, 16), float(k)), rtol=1e-6, atol=0)


needs_amx_int8 = pytest.mark.skipif(
    ops is None or not ops.small_linear_int8_supported() or not ops.small_linear_int8_amx(),
    reason="the int8 kernel's tile path needs AMX-INT8",
)


def run_both_paths(x: torch.Tensor, packed: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None, n: int):
    """The kernel's output with AMX off (vpdpwssd at every row count) and on (tiles from 4 rows)."""
    outs = []
    for amx in (False, True):
        before = ops.set_amx(amx)
        try:
            out = torch.full((x.shape[0], n), 7.0, dtype=x.dtype)
            ops.small_linear_int8(out, x, packed, s, b)
        finally:
            ops.set_amx(before)
        outs.append(out)
    return outs


@needs_amx_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (17, 64), (33, 11), (50, 34), (40, 1100), (1, 2)])
@pytest.mark.parametrize("rows", [3, 4, 5, 16, 17, 33, 129, 300])
def test_tile_path_gives_the_vpdpwssd_paths_bits(dtype: torch.dtype, n: int, k: int, rows: int) -> None:
    # Both sum the same integers exactly and round once: equal bits, NaN rows included, at every shape (N and K
    # padded, one pass or several, pair by pair or pass by pass past 128 rows).
    gen = torch.Generator().manual_seed(n * 7 + k * 3 + rows)
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    x[rows // 2, k - 1] = float("nan")
    q, s = quantize_int8(torch.randn(n, k, generator=gen))
    packed = ops.pack_small_linear_int8(q)
    for bias in (None, torch.randn(n, generator=gen)):
        vnni, tiles = run_both_paths(x, packed, s, bias, n)
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(vnni.view(bits), tiles.view(bits))
        assert tiles[rows // 2].isnan().all() and tiles[torch.arange(rows) != rows // 2].isfinite().all()


@needs_amx_int8
def test_tile_sums_cannot_overflow_at_the_largest_codes() -> None:
    # Every code at its extreme: x = +-32767 splits as 256 * 127 + 255 and 256 * -128 + 1, q = 127; over
    # K = 4,096 the hi and lo tile sums stay in int32 and the joined total is exact.
    k = 4096
    q = torch.full((32, k), 127, dtype=torch.int8)
    x = torch.ones(8, k)
    x[1::2] = -1
    x[2, ::2] = -1
    vnni, tiles = run_both_paths(x, ops.pack_small_linear_int8(q), torch.full((32,), 1 / 127), None, 32)
    want = x.sum(dim=1, keepdim=True).expand(8, 32)
    torch.testing.assert_close(tiles, want, rtol=1e-6, atol=0)
    assert torch.equal(vnni, tiles)


@needs_kernel
def test_k_zero_gives_the_bias_on_either_path() -> None:
    packed = ops.pack_small_linear_int8(torch.zeros(32, 0, dtype=torch.int8))
    bias = torch.randn(32)
    for out in run_both_paths(torch.empty(5, 0), packed, torch.ones(32), bias, 32):
        assert torch.equal(out, bias.expand(5, 32))


@needs_kernel
def test_a_row_with_a_non_finite_element_is_nan_and_others_are_not() -> None:
    q, s = quantize_int8(torch.randn(32, 16))
    x = torch.randn(3, 16)
    x[1, 4] = float("inf")
    out = torch.empty(3, 32)
    ops.small_linear_int8(out, x, ops.pack_small_linear_int8(q), s, None)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()


@needs_kernel
def test_bad_arguments_raise() -> None:
    q, s = quantize_int8(torch.randn(32, 16))
    packed = ops.pack_small_linear_int8(q)
    with pytest.raises(RuntimeError, match="another K"):
        ops.small_linear_int8(torch.empty(1, 32), torch.randn(1, 8), packed, s, None)
    with pytest.raises(RuntimeError, match="columns"):
        ops.small_linear_int8(torch.empty(1, 48), torch.randn(1, 16), packed, s, None)
    with pytest.raises(RuntimeError, match="scale"):
        ops.small_linear_int8(torch.empty(1, 32), torch.randn(1, 16), packed, s[:31], None)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.small_linear_int8(torch.empty(1, 32), torch.randn(1, 16).bfloat16(), packed, s, None)
    with pytest.raises(RuntimeError, match="pack_small_linear_int8"):
        ops.small_linear_int8(torch.empty(1, 32), torch.randn(1, 16), ops.pack_small_linear(torch.randn(32, 16)), s)
    with pytest.raises(RuntimeError, match="int8"):
        ops.pack_small_linear_int8(torch.randn(32, 16))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_keeps_only_int8_codes_and_runs_them_at_every_batch_size(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True).to(dtype)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.prepack(32, ops, int8=True)
    assert layer.weight.numel() == 0 and layer.packed_weight is None
    assert layer.small is not None and layer.small.packed.dtype == torch.int8
    q, s = quantize_int8(w)
    for rows in (1, 9, 300):
        x = torch.randn(rows, 64).to(dtype)
        assert_matches_replica(layer(x), x, q, s, b.float())
    # A row's result does not depend on the batch it is in: bit for bit.
    x = torch.randn(300, 64).to(dtype)
    assert torch.equal(layer(x)[7:8], layer(x[7:8]))


def test_without_the_kernel_the_layer_runs_the_dequantized_weight() -> None:
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=False)
    w = layer.weight.detach().clone()
    layer.prepack(32, None, int8=True)
    x = torch.randn(5, 64)
    want = F.linear(x.double(), dequantize_int8(*quantize_int8(w), torch.float32).double())
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_small_matmul_copies_rows_without_a_unit_stride() -> None:
    q, s = quantize_int8(torch.randn(20, 8))
    kernel = SmallMatmul.pack(ops, torch.empty(0), None, (q, s))
    x = torch.randn(8, 3).T  # [3, 8], column-major
    assert_matches_replica(kernel(x), x.contiguous(), q, s, None)


def test_int8_is_cpu_and_prepack_only(tiny_model_dir: str) -> None:
    with pytest.raises(ValueError, match="quantization must be"):
        ModelConfig(quantization="int4")
    with pytest.raises(ValueError, match="CPU"):
        load_model(ModelConfig(model=tiny_model_dir, quantization="int8"), torch.device("meta"))


@pytest.fixture(scope="module")
def tiny_int8(tiny_model_dir: str) -> LoadedModel:
    # bf16 activations where oneDNN has bf16 matmuls (the served default there); fp32 on an AVX2-only CPU
    dtype = "bfloat16" if onednn_has_bf16() else "float32"
    return load_model(
        ModelConfig(model=tiny_model_dir, dtype=dtype, device="cpu", quantization="int8"), torch.device("cpu")
    )


@pytest.mark.parametrize("budget", [1, 17, 4096])
def test_int8_greedy_is_independent_of_chunking_and_batch_mix(tiny_int8: LoadedModel, budget: int) -> None:
    prompts = prompts_of([5, 16, 23, 40, 70])
    alone = [make_llm(tiny_int8).generate([p], greedy())[0].outputs[0].token_ids for p in prompts]
    llm = make_llm(tiny_int8, max_num_batched_tokens=budget)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy())] == alone
    assert_pool_whole(llm)


def test_from_hf_refuses_int8_without_prepack(smollm2_checkpoint) -> None:
    with pytest.raises(ValueError, match="prepack"):
        from_hf(smollm2_checkpoint, torch.float32, torch.device("cpu"), prepack=False, quantization="int8")
