"""gate_up with SiLU-and-mul in the matmul's epilogue (``small_linear_silu_mul``, ``streamkv/model/swiglu.py``).

The contract is exactness: on gate_up's rows interleaved 16 at a time, the
op's ``act`` is bitwise ``silu_and_mul`` (``fused_layers.cpp``) of
``small_linear``'s gate_up on the weight in its own order, for dense bf16
weights and for GGUF Q4_1 / Q8_0 codes, at decode and prefill row counts,
with a bias, strided rows, special values (a NaN row, -0, values whose SiLU
overflows) and one thread walking many chunks, on AMX tiles and on vdpbf16ps
(AMX switched off; where the CPU has no AMX both parameters run vdpbf16ps).
Compared as int16 bits, so a NaN or a zero's sign counts. Then the MLP: at
every row count of a bf16 model on an AVX512-BF16 CPU it runs fused, with the
same bits as the unfused MLP on the small-batch kernel.
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


def test_interleave_puts_16_gate_rows_then_their_16_up_rows() -> None:
    order = interleave_gate_up(32)
    assert order.tolist() == [*range(0, 16), *range(32, 48), *range(16, 32), *range(48, 64)]
    assert sorted(interleave_gate_up(1536).tolist()) == list(range(3072))
    with pytest.raises(ValueError, match="multiple of 16"):
        interleave_gate_up(24)


def packs(kind: str, intermediate: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up packed in its own order, the same weight packed interleaved) for small_linear and the fused op."""
    order = interleave_gate_up(intermediate)
    if kind == "dense":
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(2 * intermediate, k, generator=g) * 0.1).bfloat16()
        return ops.pack_small_linear(w), ops.pack_small_linear(w[torch.from_numpy(order)].contiguous())
    codes = random_codes(kind, 2 * intermediate, k, seed)
    return codes.pack(ops, bf16=True), codes.rows(order).pack(ops, bf16=True)


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
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    diff = got.view(torch.int16) != want.view(torch.int16)
    assert not diff.any(), f"{int(diff.sum())} of {diff.numel()} differ, first at {diff.nonzero()[0].tolist()}"


@pytest.fixture(params=[True, False], ids=["amx", "vdpbf16ps"])
def amx(request: pytest.FixtureRequest) -> Iterator[None]:
    """The AMX tiles switched on (a no-op where the CPU has none) or off, so both kernels are checked on AMX hosts."""
    before = set_amx(request.param)
    try:
        yield
    finally:
        set_amx(before)


@NEEDS_KERNEL
@pytest.mark.usefixtures("amx")
@pytest.mark.parametrize("kind", ["dense", "q4_1", "q8_0"])
@pytest.mark.parametrize("intermediate, k", [(16, 32), (48, 96), (1536, 576)])
# 1-64 rows: the codes dequantized a tile step at a time (two passes past 32); 65 and up: dequantized panels
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 48, 64, 65, 128, 129, 256, 300])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_bitwise_silu_and_mul_of_the_unfused_matmul(
    kind: str, intermediate: int, k: int, rows: int, with_bias: bool
) -> None:
    plain, interleaved = packs(kind, intermediate, k)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(2 * intermediate, generator=g) if with_bias else None
    order = torch.from_numpy(interleave_gate_up(intermediate))
    got = silu_mul(x, interleaved, intermediate, None if bias is None else bias[order])
    assert_same_bits(got, unfused(x, plain, intermediate, bias))


@NEEDS_KERNEL
@pytest.mark.usefixtures("amx")
@pytest.mark.parametrize("kind", ["dense", "q4_1", "q8_0"])
# 176 rows: 96 pairs of 36 KB panels, 4 chunks of 1 MB on one thread, 32-row passes; 40: a decode batch (on codes,
# two passes over each pair, the first dequantizing a tile step at a time)
@pytest.mark.parametrize("rows", [40, 176])
def test_special_values_strided_rows_and_one_thread_over_many_chunks(kind: str, rows: int) -> None:
    intermediate, k = 1536, 576
    plain, interleaved = packs(kind, intermediate, k, seed=3)
    g = torch.Generator().manual_seed(4)
    big = torch.randn(rows, k + 64, generator=g).bfloat16()
    x = big[:, 32 : 32 + k]  # rows 2 * (k + 64) bytes apart
    x[3] = float("nan")  # one row of NaN: only its outputs are NaN
    x[5] = 3e38  # sums past fp32's range: gate and up +-inf, silu(-inf) * inf
    x[7] = 0.0  # every output silu(bias_g) * bias_u
    bias = torch.randn(2 * intermediate, generator=g)
    bias[[0, 40, 70]] = torch.tensor([float("inf"), float("-inf"), float("nan")])  # gate columns 0, 40 and 70
    bias[intermediate + 1] = -0.0
    order = torch.from_numpy(interleave_gate_up(intermediate))
    out = torch.full((rows, intermediate + 40), 7.0, dtype=torch.bfloat16)
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
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        ops.small_linear_silu_mul(act.float(), x.float(), interleaved, None)
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
        ops.small_linear_silu_mul(act, torch.randn(4, 64).bfloat16(), codes.pack(ops, bf16=True), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.small_linear_silu_mul(act, x, interleaved, torch.zeros(48))


def test_pack_declines_what_the_kernel_cannot_take() -> None:
    w = torch.randn(96, 64).bfloat16()
    assert GateUpSiluMul.pack(ops, w.float()) is None  # float32
    assert GateUpSiluMul.pack(ops, torch.randn(80, 64).bfloat16()) is None  # I = 40
    assert GateUpSiluMul.pack(ops, torch.randn(96, 48).bfloat16()) is None  # K = 48
    fused_gate_up = GateUpSiluMul.pack(ops, w)
    assert fused_gate_up is not None and fused_gate_up.intermediate == 48
    supported = bool(ops.small_linear_silu_mul_supported())
    for on in (True, False):  # AMX tiles: every batch; vdpbf16ps: prefill-sized ones (past 128 rows)
        before = set_amx(on)
        try:
            tiles = supported and bool(ops.amx())
            assert fused_gate_up.takes(1) == fused_gate_up.takes(128) == tiles and not fused_gate_up.takes(0)
            assert fused_gate_up.takes(129) == fused_gate_up.takes(4096) == supported
        finally:
            set_amx(before)


def bf16_llama(mlp_bias: bool) -> LlamaForCausalLM:
    """hidden 64 (K a multiple of 32) and I = 96 (a multiple of 16): the fused kernel takes its gate_up."""
    return small_llama(torch.bfloat16, hidden=64, intermediate=96, heads=4, mlp_bias=mlp_bias)


@NEEDS_KERNEL
@pytest.mark.usefixtures("amx")
@pytest.mark.parametrize("mlp_bias", [False, True], ids=["no-bias", "bias"])
def test_a_bf16_mlp_runs_every_batch_fused_with_the_unfused_bits(mlp_bias: bool) -> None:
    model = bf16_llama(mlp_bias)
    assert model.prepack_cpu_weights(small_ops=ops)
    assert model.use_fused_ops(fused)
    mlp = model.model.layers[0].mlp
    assert mlp.silu_mul is not None
    calls: list[int] = []
    original = ops.small_linear_silu_mul

    class Spy:
        def __getattr__(self, name: str) -> object:
            return getattr(ops, name)

        def small_linear_silu_mul(self, act: torch.Tensor, *args: object) -> None:
            calls.append(act.shape[0])
            original(act, *args)

    mlp.silu_mul = GateUpSiluMul(Spy(), mlp.silu_mul.packed, mlp.silu_mul.intermediate, mlp.silu_mul.bias)  # type: ignore[arg-type]
    every = (1, 64, 65, 129, 700)
    for rows in every:  # decode rows (one and two passes a pair, then 65-128) and prefill rows
        x = torch.randn(rows, 64).bfloat16()
        with torch.inference_mode():
            got = mlp.forward(x)
            act = x.new_empty(rows, 96)
            fused.silu_and_mul(act, mlp.gate_up_proj.small(x))  # gate_up on the small-batch kernel at any rows
            want = mlp.down_proj.forward(act)
        assert_same_bits(got, want)
    assert calls == [rows for rows in every if rows > 128 or ops.amx()]  # vdpbf16ps: prefill-sized steps alone


def test_int8_and_float32_models_keep_the_unfused_mlp() -> None:
    model = bf16_llama(False)
    assert model.prepack_cpu_weights(small_ops=ops, int8=True)
    assert all(layer.mlp.silu_mul is None for layer in model.model.layers)
    model32 = small_llama(torch.float32, hidden=64, intermediate=96, heads=4)
    assert model32.prepack_cpu_weights(small_ops=ops)
    assert all(layer.mlp.silu_mul is None for layer in model32.model.layers)
