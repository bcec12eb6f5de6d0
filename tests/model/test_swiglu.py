"""gate_up with SiLU-and-mul in the matmul's epilogue (``small_linear_silu_mul``, ``streamkv/model/swiglu.py``).

The contract is exactness: on gate_up's rows interleaved 16 at a time, the
op's ``act`` is bitwise ``silu_and_mul`` (``fused_layers.cpp``) of
``small_linear``'s gate_up on the weight in its own order, in bf16 and in
float32, for dense weights and for GGUF Q4_1 / Q8_0 codes, at decode and
prefill row counts, with a bias, strided rows, special values (a NaN row, -0,
values whose SiLU overflows) and one thread walking many chunks, on AMX tiles
and on vdpbf16ps (AMX switched off; where the CPU has no AMX both parameters
run vdpbf16ps; float32 always runs the FMA kernel's passes). Compared as
integer bits, so a NaN or a zero's sign counts. Then the MLP: the batches it
runs fused (bf16: every one on AMX, past 128 rows on vdpbf16ps; float32: past
128 rows, AMX off) have the same bits as the unfused MLP on the small-batch
kernel.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from streamkv.model.llama import LlamaForCausalLM
from streamkv.model.swiglu import GateUpSiluMul, interleave_gate_up
from streamkv.ops.cpu_ops import load_fused_ops, load_linear_ops, set_amx
from tests.test_fused_ops import small_llama
from tests.test_gguf_codes import random_codes

ops = load_linear_ops()
fused = load_fused_ops()
pytestmark = pytest.mark.skipif(ops is None or fused is None, reason="the C++ linear and fused ops are not built here")
NEEDS_KERNEL = pytest.mark.skipif(
    ops is None or not ops.small_linear_silu_mul_supported(), reason="the fused gate_up needs AVX512-BF16"
)
NEEDS_F32_KERNEL = pytest.mark.skipif(
    ops is None or not ops.small_linear_silu_mul_supported(f32=True), reason="the fp32 fused gate_up needs AVX-512"
)
# bf16 needs AVX512-BF16, float32 AVX-512: each dtype skips where its kernel is not built
DTYPES = [
    pytest.param(torch.bfloat16, id="bf16", marks=NEEDS_KERNEL),
    pytest.param(torch.float32, id="fp32", marks=NEEDS_F32_KERNEL),
]


def test_interleave_puts_16_gate_rows_then_their_16_up_rows() -> None:
    order = interleave_gate_up(32)
    assert order.tolist() == [*range(0, 16), *range(32, 48), *range(16, 32), *range(48, 64)]
    assert sorted(interleave_gate_up(1536).tolist()) == list(range(3072))
    with pytest.raises(ValueError, match="multiple of 16"):
        interleave_gate_up(24)


def packs(
    kind: str, intermediate: int, k: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up packed in its own order, the same weight packed interleaved) for small_linear and the fused op."""
    order = interleave_gate_up(intermediate)
    if kind == "dense":
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(2 * intermediate, k, generator=g) * 0.1).to(dtype)
        return ops.pack_small_linear(w), ops.pack_small_linear(w[torch.from_numpy(order)].contiguous())
    codes = random_codes(kind, 2 * intermediate, k, seed)
    bf16 = dtype == torch.bfloat16
    return codes.pack(ops, bf16=bf16), codes.rows(order).pack(ops, bf16=bf16)


def unfused(x: torch.Tensor, packed: torch.Tensor, intermediate: int, bias: torch.Tensor | None) -> torch.Tensor:
    gate_up = x.new_empty(x.shape[0], 2 * intermediate)
    ops.small_linear(gate_up, x, packed, bias)
    act = x.new_empty(x.shape[0], intermediate)
    fused.silu_and_mul(act, gate_up)
    return act


def silu_mul(x: torch.Tensor, packed: torch.Tensor, intermediate: int, bias: torch.Tensor | None) -> torch.Tensor:
    act = x.new_empty(x.shape[0], intermediate)
    ops.small_linear_silu_mul(act, x, packed, bias)
    return act


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype and got.dtype in (torch.bfloat16, torch.float32)
    bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    diff = got.view(bits) != want.view(bits)
    assert not diff.any(), f"{int(diff.sum())} of {diff.numel()} differ, first at {diff.nonzero()[0].tolist()}"


@pytest.fixture(params=[True, False], ids=["amx", "vdpbf16ps"])
def amx(request: pytest.FixtureRequest) -> Iterator[None]:
    """The AMX tiles switched on (a no-op where the CPU has none) or off, so both kernels are checked on AMX hosts."""
    before = set_amx(request.param)
    try:
        yield
    finally:
        set_amx(before)


@pytest.mark.usefixtures("amx")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["dense", "q4_1", "q8_0"])
@pytest.mark.parametrize("intermediate, k", [(16, 32), (48, 96), (1536, 576)])
# bf16 on AMX: 1-64 rows the codes dequantized a tile step at a time (two passes past 32); 65 and up: dequantized
# panels. Unfused, fp32 and bf16 on vdpbf16ps walk one pass a pair up to 12 rows, then later passes from the first's
# panel up to 128, then the chunk walk (what the fused op walks at every row count).
@pytest.mark.parametrize("rows", [1, 12, 13, 15, 16, 17, 32, 33, 48, 64, 65, 128, 129, 256, 300])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_bitwise_silu_and_mul_of_the_unfused_matmul(
    dtype: torch.dtype, kind: str, intermediate: int, k: int, rows: int, with_bias: bool
) -> None:
    plain, interleaved = packs(kind, intermediate, k, dtype=dtype)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(2 * intermediate, generator=g) if with_bias else None
    order = torch.from_numpy(interleave_gate_up(intermediate))
    got = silu_mul(x, interleaved, intermediate, None if bias is None else bias[order])
    assert_same_bits(got, unfused(x, plain, intermediate, bias))


@pytest.mark.usefixtures("amx")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["dense", "q4_1", "q8_0"])
# 176 rows: 96 pairs of 36 KB (bf16) or 72 KB (fp32) panels, several 1 MB chunks on one thread, 32-row passes; 40: a
# decode batch (bf16 on AMX codes: two passes over each pair, the first dequantizing a tile step at a time)
@pytest.mark.parametrize("rows", [40, 176])
def test_special_values_strided_rows_and_one_thread_over_many_chunks(dtype: torch.dtype, kind: str, rows: int) -> None:
    intermediate, k = 1536, 576
    plain, interleaved = packs(kind, intermediate, k, seed=3, dtype=dtype)
    g = torch.Generator().manual_seed(4)
    big = torch.randn(rows, k + 64, generator=g).to(dtype)
    x = big[:, 32 : 32 + k]  # rows 2 * (k + 64) bytes apart
    x[3] = float("nan")  # one row of NaN: only its outputs are NaN
    x[5] = 3e38  # sums past fp32's range: gate and up +-inf, silu(-inf) * inf
    x[7] = 0.0  # every output silu(bias_g) * bias_u
    bias = torch.randn(2 * intermediate, generator=g)
    bias[[0, 40, 70]] = torch.tensor([float("inf"), float("-inf"), float("nan")])  # gate columns 0, 40 and 70
    bias[intermediate + 1] = -0.0
    order = torch.from_numpy(interleave_gate_up(intermediate))
    out = torch.full((rows, intermediate + 40), 7.0, dtype=dtype)
    act = out[:, 8 : 8 + intermediate]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ops.small_linear_silu_mul(act, x, interleaved, bias[order])
    finally:
        torch.set_num_threads(threads)
    want = unfused(x.contiguous(), plain, intermediate, bias)
    assert_same_bits(act, want)
    assert act[3].isnan().all()  # the NaN row, and elsewhere only the columns of the NaN and -inf biases
    nan_columns = set(act[[0, 1, 2, 4, 6]].isnan().any(dim=0).nonzero().flatten().tolist())
    assert 70 in nan_columns and nan_columns <= {40, 70}
    assert not torch.isfinite(act[5]).any()  # the overflow row: every output inf or NaN (inf - inf in the sums)
    assert act[7, 0].isinf()  # silu(inf) * u
    assert (out[:, :8] == 7).all() and (out[:, 8 + intermediate :] == 7).all()  # nothing outside act is written


def test_bad_arguments_raise() -> None:
    plain, interleaved = packs("dense", 48, 96)
    x = torch.randn(4, 96).bfloat16()
    act = torch.empty(4, 48, dtype=torch.bfloat16)
    if not ops.small_linear_silu_mul_supported():
        with pytest.raises(RuntimeError, match="needs AVX512-BF16"):
            ops.small_linear_silu_mul(act, x, interleaved, None)
        return
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        ops.small_linear_silu_mul(act.float(), x, interleaved, None)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        ops.small_linear_silu_mul(act.half(), x.half(), interleaved, None)
    with pytest.raises(RuntimeError, match=r"pack_small_linear \(float32\)"):
        ops.small_linear_silu_mul(act.float(), x.float(), interleaved, None)  # the bf16 pack under float32 x
    with pytest.raises(RuntimeError, match="I a multiple of 16"):
        ops.small_linear_silu_mul(torch.empty(4, 40, dtype=torch.bfloat16), x, interleaved, None)
    with pytest.raises(RuntimeError, match="rows for 2I"):
        ops.small_linear_silu_mul(torch.empty(4, 32, dtype=torch.bfloat16), x, interleaved, None)
    with pytest.raises(RuntimeError, match="must come from"):
        ops.small_linear_silu_mul(act, x, ops.pack_small_linear(torch.randn(96, 96)), None)
    with pytest.raises(RuntimeError, match="must come from"):
        ops.small_linear_silu_mul(act, torch.randn(4, 64).bfloat16(), interleaved, None)  # packed for K = 96
    codes = random_codes("q4_1", 96, 96)
    with pytest.raises(RuntimeError, match="must come from"):
        ops.small_linear_silu_mul(act, x, codes.pack(ops, bf16=False), None)  # the float32 x layout
    with pytest.raises(RuntimeError, match="must come from"):
        ops.small_linear_silu_mul(act.float(), x.float(), codes.pack(ops, bf16=True), None)  # the bf16 x layout
    with pytest.raises(RuntimeError, match="must come from"):
        ops.small_linear_silu_mul(act, torch.randn(4, 64).bfloat16(), codes.pack(ops, bf16=True), None)
    with pytest.raises(RuntimeError, match="must come from"):  # a float32 pack for K = 96 under K = 64
        ops.small_linear_silu_mul(act.float(), torch.randn(4, 64), ops.pack_small_linear(torch.randn(96, 96)), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.small_linear_silu_mul(act, x, interleaved, torch.zeros(48))


@NEEDS_KERNEL
def test_pack_declines_what_the_kernel_cannot_take() -> None:
    w = torch.randn(96, 64).bfloat16()
    assert GateUpSiluMul.pack(ops, w.half()) is None  # float16
    assert GateUpSiluMul.pack(ops, torch.randn(80, 64).bfloat16()) is None  # I = 40
    assert GateUpSiluMul.pack(ops, torch.randn(96, 48)) is None  # K = 48
    fused_gate_up = GateUpSiluMul.pack(ops, w)
    assert fused_gate_up is not None and fused_gate_up.intermediate == 48 and fused_gate_up.dtype == torch.bfloat16
    fused32 = GateUpSiluMul.pack(ops, w.float())
    assert fused32 is not None and fused32.dtype == torch.float32 and fused32.packed.dtype == torch.float32
    for on in (True, False):  # bf16 on AMX tiles: every batch; else prefill-sized ones (past 128 rows)
        before = set_amx(on)
        try:
            tiles = bool(ops.amx())
            assert fused_gate_up.takes(1) == fused_gate_up.takes(128) == tiles and not fused_gate_up.takes(0)
            assert fused_gate_up.takes(129) and fused_gate_up.takes(4096)
            assert not fused32.takes(1) and not fused32.takes(128)  # fp32: never a decode batch
            assert fused32.takes(129) == fused32.takes(4096) == (not tiles)  # nor with AMX on (tiles sum otherwise)
        finally:
            set_amx(before)


def fusable_llama(mlp_bias: bool, dtype: torch.dtype = torch.bfloat16) -> LlamaForCausalLM:
    """hidden 64 (K a multiple of 32) and I = 96 (a multiple of 16): the fused kernel takes its gate_up."""
    return small_llama(dtype, hidden=64, intermediate=96, heads=4, mlp_bias=mlp_bias)


@pytest.mark.usefixtures("amx")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mlp_bias", [False, True], ids=["no-bias", "bias"])
def test_the_mlp_runs_fused_where_it_takes_the_rows_with_the_unfused_bits(dtype: torch.dtype, mlp_bias: bool) -> None:
    model = fusable_llama(mlp_bias, dtype)
    assert model.prepack_cpu_weights(small_ops=ops)
    assert model.use_fused_ops(fused)
    mlp = model.model.layers[0].mlp
    if dtype == torch.float32 and ops.amx():
        assert mlp.silu_mul is None  # fp32 on AMX tiles sums prefill rows in another order: no fused copy
        return
    assert mlp.silu_mul is not None
    calls: list[int] = []
    original = ops.small_linear_silu_mul

    class Spy:
        def __getattr__(self, name: str) -> object:
            return getattr(ops, name)

        def small_linear_silu_mul(self, act: torch.Tensor, *args: object) -> None:
            calls.append(act.shape[0])
            original(act, *args)

    s = mlp.silu_mul
    mlp.silu_mul = GateUpSiluMul(Spy(), s.packed, s.intermediate, s.bias, s.dtype)  # type: ignore[arg-type]
    every = (1, 64, 65, 129, 700)
    for rows in every:  # decode rows (one and two passes a pair, then 65-128) and prefill rows
        x = torch.randn(rows, 64).to(dtype)
        with torch.inference_mode():
            got = mlp.forward(x)
            act = x.new_empty(rows, 96)
            fused.silu_and_mul(act, mlp.gate_up_proj.small(x))  # gate_up on the small-batch kernel at any rows
            want = mlp.down_proj.forward(act)
        assert_same_bits(got, want)
    tiles = dtype == torch.bfloat16 and ops.amx()
    assert calls == [rows for rows in every if rows > 128 or tiles]  # else prefill-sized steps alone


def test_int8_models_keep_the_unfused_mlp() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        model = fusable_llama(False, dtype)
        assert model.prepack_cpu_weights(small_ops=ops, int8=True)
        assert all(layer.mlp.silu_mul is None for layer in model.model.layers)
