"""The small-batch linear op (``streamkv/ops/csrc/small_linear.cpp``) against torch's matmul, and the layer's dispatch.

fp32 must match ``F.linear`` to a few fp32 ulps of the dot products (another
summation order); bf16 must match the fp32 product of the same bf16 inputs
rounded once to bf16, to within one bf16 ulp (the order of the fp32 sums can
move a rounding by one step). Shapes cover column tails (N not a multiple of
16), odd pairs of columns, K tails, biases, strided rows of x, and row counts
on both sides of every internal block (up to 12 rows per pass of the float
kernels and 8 of the int8 one, 2 column blocks). A row's result must not
depend on the batch it is in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from streamkv.model.linear import AMX_TILE_K, Linear, SmallMatmul
from streamkv.ops.cpu_ops import load_linear_ops, set_amx

ops = load_linear_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the small-batch linear op cannot be built or run here")
NO_BF16 = pytest.mark.skipif(
    ops is None or not ops.small_linear_bf16_supported(), reason="the bf16 kernel needs AVX512-BF16"
)
NO_AMX = pytest.mark.skipif(
    ops is None or not ops.amx(), reason="bf16 on AMX tiles needs a CPU with AMX-BF16 (and the OS's grant)"
)


@pytest.fixture(
    params=[
        pytest.param((torch.float32, None), id="float32"),
        pytest.param((torch.bfloat16, False), id="bfloat16", marks=NO_BF16),
        pytest.param((torch.bfloat16, True), id="bfloat16-amx", marks=NO_AMX),
    ]
)
def dtype(request: pytest.FixtureRequest) -> Iterator[torch.dtype]:
    """The weights' dtype; bf16 runs on the vdpbf16ps kernel and, where the CPU has AMX, on AMX tiles."""
    dtype, amx = request.param
    if amx is None:
        yield dtype
        return
    before = set_amx(amx)
    try:
        assert ops.amx() == amx
        yield dtype
    finally:
        set_amx(before)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    want = reference(x, w, b)
    assert got.dtype == x.dtype and got.shape == want.shape
    if x.dtype == torch.float32:
        scale = (x.double().abs() @ w.double().abs().T).max().item()
        torch.testing.assert_close(got.double(), want, atol=1e-6 * scale, rtol=0)
    else:
        # One bf16 ulp of the exact value (2^-7 relative, from its exponent), plus the fp32 sums' drift, which
        # scales with the sum of the magnitudes of the products (an output near 0 after cancellation has a tiny
        # ulp but the drift of its large terms).
        ulp = torch.pow(2.0, torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
        drift = 1e-6 * F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
        assert ((got.double() - want).abs() <= ulp + drift).all(), f"max |diff| {(got.double() - want).abs().max()}"


@pytest.mark.parametrize(
    "n, k", [(960, 576), (16, 64), (17, 64), (33, 10), (50, 34), (1, 2), (576, 1536), (50, 300), (40, 129)]
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 17, 25, 33, 37, 64, 128])
def test_matches_the_matmul(dtype: torch.dtype, n: int, k: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    packed = ops.pack_small_linear(w)
    for bias in (None, b):
        out = torch.full((rows, n), float("nan"), dtype=dtype)
        ops.small_linear(out, x, packed, bias)
        assert_close(out, x, w, bias)


@pytest.mark.parametrize("n, k", [(960, 576), (50, 34), (50, 300), (40, 1300), (70, 1536)])
def test_a_rows_result_is_the_same_in_every_batch(dtype: torch.dtype, n: int, k: int) -> None:
    # Greedy output must not change with the batch mix: each output is one fp32 sum over k ascending, whichever
    # pass (and pass size: 12 rows, or 11 + 11 + 10 at 32) computes it, and whichever thread owns its columns.
    # K = 1,300 splits k into blocks whose size changes with the rows on AVX2 (ten of 119 steps and one of 110
    # up to 32 rows, two of 434 and one of 432 past them), the sums parked in out between them.
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    packed = ops.pack_small_linear(w)
    x = torch.randn(1100, k, generator=gen).to(dtype)
    alone = torch.empty(x.shape[0], n, dtype=dtype)
    for r in range(x.shape[0]):
        ops.small_linear(alone[r : r + 1], x[r : r + 1], packed, b)
    threads = torch.get_num_threads()
    try:
        for num_threads in {1, threads}:
            torch.set_num_threads(num_threads)
            for rows in (2, 3, 4, 5, 8, 9, 11, 12, 13, 24, 32, 33, 64, 100, 130, 600, 1100):
                out = torch.empty(rows, n, dtype=dtype)
                ops.small_linear(out, x[:rows], packed, b)
                assert torch.equal(out, alone[:rows]), (num_threads, rows)
    finally:
        torch.set_num_threads(threads)


def test_no_rows_is_an_empty_result(dtype: torch.dtype) -> None:
    out = torch.empty(0, 40, dtype=dtype)
    ops.small_linear(out, torch.empty(0, 32, dtype=dtype), ops.pack_small_linear(torch.randn(40, 32).to(dtype)), None)
    assert out.shape == (0, 40)


@pytest.mark.parametrize("rows, k", [(5, 32), (13, 300), (40, 1300), (40, 576)])
def test_strided_rows_of_x_and_out(dtype: torch.dtype, rows: int, k: int) -> None:
    # The attention output reshaped, a slice of a wider buffer: rows with a stride other than K. With K past one
    # block of k (the AVX2 kernel parks partial sums in out between blocks), out's stride matters there too.
    w = torch.randn(40, k).to(dtype)
    wide = torch.randn(rows, k + 16).to(dtype)
    x = wide[:, 8 : 8 + k]
    out_buf = torch.full((rows, 64), float("nan"), dtype=dtype)
    out = out_buf[:, 4:44]
    ops.small_linear(out, x, ops.pack_small_linear(w), None)
    assert_close(out, x, w, None)
    assert out_buf[:, :4].isnan().all() and out_buf[:, 44:].isnan().all()  # nothing written past its columns


def test_no_k_gives_the_bias(dtype: torch.dtype) -> None:
    # K = 0: every output is the bias alone, at decode sizes and past 128 rows (run_amx's pass-by-pass order).
    packed = ops.pack_small_linear(torch.empty(40, 0, dtype=dtype))
    b = torch.randn(40).to(dtype)
    for rows in (1, 200):
        out = torch.full((rows, 40), float("nan"), dtype=dtype)
        ops.small_linear(out, torch.empty(rows, 0, dtype=dtype), packed, b)
        assert torch.equal(out, b.expand(rows, 40))


@NO_AMX
def test_amx_runs_its_own_kernel() -> None:
    # The bfloat16-amx cases above would pass on the vdpbf16ps kernel too: the two kernels sum in different
    # orders, so over 64 x 960 outputs of K = 576 some last bits differ, and both stay within the bound.
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(960, 576, generator=gen).bfloat16()
    x = torch.randn(64, 576, generator=gen).bfloat16()
    packed = ops.pack_small_linear(w)
    outs = []
    before = set_amx(True)
    try:
        for amx in (True, False):
            set_amx(amx)
            out = torch.empty(64, 960, dtype=torch.bfloat16)
            ops.small_linear(out, x, packed, None)
            assert_close(out, x, w, None)
            outs.append(out)
    finally:
        set_amx(before)
    assert not torch.equal(outs[0], outs[1])


@NO_AMX
def test_the_amx_switch_moves_every_extension() -> None:
    # decode_layer's extension holds its own copy of small_linear, and the attention ops their own switch for
    # the bf16 prefill kernel: all must run the same kernels, or a decode row's bits would depend on whether
    # its step ran the one-call layer or the layer-by-layer path.
    from streamkv.ops.cpu_ops import load_cpu_ops, load_decode_ops

    decode, attention = load_decode_ops(), load_cpu_ops()
    assert decode is not None and attention is not None
    before = set_amx(False)
    try:
        assert not ops.amx() and not decode.amx() and not attention.amx()
        set_amx(True)
        assert ops.amx() and decode.amx() and attention.amx()
    finally:
        set_amx(before)


def test_bad_arguments_raise() -> None:
    w = torch.randn(32, 16)
    packed = ops.pack_small_linear(w)
    with pytest.raises(RuntimeError, match="another K"):
        ops.small_linear(torch.empty(1, 32), torch.randn(1, 8), packed, None)
    with pytest.raises(RuntimeError, match="columns"):
        ops.small_linear(torch.empty(1, 48), torch.randn(1, 16), packed, None)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.small_linear(torch.empty(1, 32), torch.randn(1, 16).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.small_linear(torch.empty(1, 32), torch.randn(1, 16), packed, torch.zeros(31))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.pack_small_linear(w.half())


@pytest.mark.parametrize(
    "in_features, out_features, amx",
    [(64, 96, False), (64, 96, True), (64, 1056, True), (40, 96, True)],
    ids=["amx-off", "amx", "amx-wide", "odd-k"],  # odd-k: K not a multiple of AMX_TILE_K, off run_amx
)
def test_layer_takes_the_kernel_at_every_batch_size_and_keeps_no_onednn_copy(
    dtype: torch.dtype, in_features: int, out_features: int, amx: bool
) -> None:
    # One kernel for every row count, so a row's result does not depend on its batch or chunk (until round 44
    # rows past 128 went to oneDNN). The routing reads the switch through ops.amx(); the spy answers `amx`
    # whatever the CPU (the rows still run on whichever kernel the CPU has).
    assert in_features % AMX_TILE_K == 0 or in_features == 40
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias=True).to(dtype)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.prepack(32, ops)
    assert layer.weight.numel() == 0 and layer.small is not None
    assert layer.packed_weight is None  # no oneDNN copy: the kernel runs every batch
    calls = []
    real = layer.small.ops

    class Spy:
        def small_linear(self, *args: object) -> None:
            calls.append(args[1].shape[0])
            real.small_linear(*args)

        def amx(self) -> bool:
            return amx

    layer.small = dataclasses.replace(layer.small, ops=Spy())
    sizes = [1, 128, 129, 1024, 1025, 4100]
    alone = []
    for rows in sizes:
        x = torch.randn(rows, in_features).to(dtype)
        got = layer(x)
        assert_close(got, x, w, b)
        alone.append((x[-1:], got[-1:]))
    assert calls == sizes
    for x, got in alone:  # the last row of each batch, alone, gives the same bits
        assert torch.equal(layer(x), got)


def test_small_matmul_copies_rows_without_a_unit_stride() -> None:
    w = torch.randn(20, 8)
    x = torch.randn(8, 3).T  # [3, 8], column-major
    assert_close(SmallMatmul.pack(ops, w)(x), x, w, None)


def test_bench_small_linear_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    from load_tests import bench_small_linear

    args = ["--rows", "1,9", "--dtypes", "float32,bfloat16,int8,gguf", "--rounds", "1", "--layers", "1"]
    assert bench_small_linear.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    for name in ("float32", "bfloat16", "int8", "gguf"):
        rows = [line for line in out if line.startswith(f"| {name} |")]
        if name == "int8" and not ops.small_linear_int8_supported():
            assert rows and "VNNI" in rows[0]
            continue
        if name == "gguf" and not ops.small_linear_gguf_supported():
            assert rows and "AVX-512" in rows[0]
            continue
        if name == "bfloat16" and not ops.small_linear_bf16_supported():
            assert rows and "AVX512-BF16" in rows[0]
            continue
        assert [r.split("|")[2].strip() for r in rows] == ["1", "9"]
        assert all(float(r.split("|")[7].strip().rstrip("x")) > 0 for r in rows)
