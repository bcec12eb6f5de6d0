"""The fused C++ layer ops (``streamkv/ops/csrc/fused_layers.cpp``) against the torch ops they replace.

Op level: each op against the torch expression of ``streamkv/model/llama.py``
on shapes with vector tails (sizes not multiples of 16) and strided inputs;
bf16 results must be bitwise equal (the op rounds where torch does), fp32
within a few ulps (the sum of squares runs in a different order). For the
norms that order also decides a few bf16 roundings: ``x * rsqrt(mean)`` one
fp32 ulp apart can round to neighbouring bf16 values, so a norm's bf16 output
may differ from torch's by one bf16 step in a few elements (seen on an AVX2
build, whose sum is sequential; the AVX-512 build happened to match here). Model
level: a small random Llama on a NaN-poisoned paged pool, one mixed step
(a fresh prefill, a chunk after cached tokens, decodes), torch ops vs fused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from streamkv.attention.metadata import AttentionMetadata
from streamkv.attention.torch_paged import TorchPagedAttention
from streamkv.model.llama import LlamaConfig, LlamaForCausalLM
from streamkv.model.rope import apply_rope
from streamkv.ops.cpu_ops import load_fused_ops

ops = load_fused_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the fused C++ ops could not be built here")

DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5


def torch_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, EPS)
    return w * F.rms_norm(x.float(), w.shape, eps=EPS).to(x.dtype)


def assert_matches(got: torch.Tensor, want: torch.Tensor, *, summed: bool = False) -> None:
    """``summed``: the op sums squares in its own order (the norms): bf16 may be one step off in 1 of 1,000."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16 and summed:
        # same sign: adjacent bf16 values are 1 apart as int16
        steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert int(steps.max()) <= 1 and int((steps > 0).sum()) * 1000 <= got.numel(), f"{int((steps > 0).sum())} off"
    elif got.dtype == torch.bfloat16:
        assert torch.equal(got, want), f"max |diff| {(got.float() - want.float()).abs().max().item()}"
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 581])
def test_rms_norm_and_add_rms_norm_match_torch(dtype: torch.dtype, hidden: int) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(37, hidden, generator=g) * 3).to(dtype)
    residual = torch.randn(37, hidden, generator=g).to(dtype)
    w = (1 + torch.randn(hidden, generator=g) * 0.1).to(dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, EPS)
    assert_matches(out, torch_rms_norm(x, w), summed=True)

    summed = residual + x
    res = residual.clone()
    ops.add_rms_norm(out, x, res, w, EPS)
    assert torch.equal(res, summed)  # the residual add rounds like torch's
    assert_matches(out, torch_rms_norm(summed, w), summed=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [128, 203])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, inter: int) -> None:
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(29, 2 * inter, generator=g) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and signed zero
    out = gate_up.new_empty(29, inter)
    ops.silu_and_mul(out, gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    assert_matches(out, F.silu(gate) * up)


def test_bf16_silu_and_mul_is_torchs_for_every_bf16_gate() -> None:
    """bf16 silu is a table of torch's own silu of each bf16 value: every one of the 65,536 gates (NaNs, infinities,
    subnormals, both zeros) gives torch's bits, the sign of a zero included, times an up of either sign; 203 columns
    run the vector loop (16 lanes, or 8 on AVX2) and the scalar tail."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = torch.cat([gate, gate[: 203 * 323 - gate.numel()]]).view(323, 203)
    up = torch.randn(323, 203, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = gate.new_empty(323, 203)
    ops.silu_and_mul(out, torch.cat([gate, up], 1))
    want = F.silu(gate) * up
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 64, 128])  # the scalar loop, and the 16-lane halves
def test_rope_matches_torch_on_a_strided_view(dtype: torch.dtype, d: int) -> None:
    g = torch.Generator().manual_seed(1)
    tokens, hq, hkv = 23, 6, 2
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(dtype)
    x = qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d)  # q and k heads, rows strided past v
    cos = torch.randn(tokens, 1, d, generator=g).to(dtype)
    sin = torch.randn(tokens, 1, d, generator=g).to(dtype)
    out = torch.empty(x.shape, dtype=dtype)
    ops.rope(out, x, cos, sin)
    assert_matches(out, apply_rope(x, cos, sin))


def test_bf16_results_keep_subnormals_and_nan_as_torch_does() -> None:
    """A bf16 store rounds with vcvtneps2bf16 where the CPU has it, which reads subnormals as zero: a vector with
    a subnormal or NaN lane must take the integer rule, so those lanes keep torch's bits (NaN: stays NaN)."""
    g = torch.Generator().manual_seed(7)
    gate = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    up = (torch.randn(9, 64, generator=g) * 1e-39).to(torch.bfloat16)  # products below float32's normal range
    up[0, 5], up[1, :] = float("nan"), torch.randn(64, generator=g).to(torch.bfloat16)  # a NaN lane; a normal row
    out = gate.new_empty(9, 64)
    ops.silu_and_mul(out, torch.cat([gate, up], 1))
    want = F.silu(gate) * up
    assert int(((want != 0) & (want.float().abs() < torch.finfo(torch.float32).tiny)).sum()) > 100
    assert torch.isnan(out[0, 5]) and torch.equal(out.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(out[ok].view(torch.int16), want[ok].view(torch.int16))

    x = (torch.randn(5, 3, 64, generator=g) * 1e-39).to(torch.bfloat16)  # cos 1, sin 0: subnormal results
    cos, sin = torch.ones(5, 1, 64, dtype=torch.bfloat16), torch.zeros(5, 1, 64, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    ops.rope(out, x, cos, sin)
    want = apply_rope(x, cos, sin)
    assert int((want != 0).sum()) > 800 and torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_ops_refuse_bad_input_with_a_clear_error() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.rms_norm(torch.empty_like(x), x, torch.ones(8, dtype=torch.bfloat16), EPS)
    with pytest.raises(RuntimeError, match="shapes"):
        ops.silu_and_mul(torch.empty(4, 3), x)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(x.half(), x.half(), torch.ones(8).half(), EPS)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    out = torch.empty(logits.shape[0], dtype=torch.long)
    ops.argmax_rows(out, logits)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 15, 16, 17, 300, 49152])
def test_argmax_rows_equals_torch_argmax_with_ties_and_a_strided_view(vocab: int, dtype: torch.dtype) -> None:
    # bf16 rows (a bf16 model's logits, read as they come) must answer as their float32 widening does
    torch.manual_seed(vocab)
    x = torch.randn(9, vocab).to(dtype)
    assert torch.equal(argmax_rows(x), x.float().argmax(-1))
    ties = torch.randint(-2, 3, (9, vocab)).to(dtype)  # many equal maxima per row: the first one wins
    assert torch.equal(argmax_rows(ties), ties.float().argmax(-1))
    wide = torch.randn(5, vocab + 7).to(dtype)[:, 3 : 3 + vocab]  # rows of a wider tensor: row stride != vocab
    assert torch.equal(argmax_rows(wide), wide.float().argmax(-1))
    zeros = torch.full((3, vocab), -1.0, dtype=dtype)
    zeros[0, -1], zeros[1, 0], zeros[2, vocab // 2 :] = 0.0, -0.0, torch.tensor(-0.0)  # -0.0 == 0.0: first one wins
    zeros[2, -1] = 0.0
    assert torch.equal(argmax_rows(zeros), zeros.float().argmax(-1))
    if dtype == torch.bfloat16:  # values fp32 tells apart that round to one bf16: the first of them wins
        near = torch.full((2, vocab), -3.0)
        near[:, -1] = 1.0
        near[:, 0] = 1.0 - 2**-12
        assert torch.equal(argmax_rows(near.to(dtype)), torch.zeros(2, dtype=torch.long))
        assert torch.equal(argmax_rows(near), torch.full((2,), vocab - 1, dtype=torch.long))


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(1, 100),
    specials=st.lists(st.tuples(st.integers(0, 99), st.sampled_from([float("nan"), float("inf"), float("-inf")]))),
)
def test_argmax_rows_takes_nan_and_infinities_as_torch_does(vocab: int, specials: list[tuple[int, float]]) -> None:
    x = torch.full((2, vocab), float("-inf"))  # row 0 stays all -inf: index 0
    x[1] = torch.linspace(-1, 1, vocab)
    for i, v in specials:
        x[1, i % vocab] = v
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert torch.equal(argmax_rows(x.bfloat16()), x.bfloat16().float().argmax(-1))


def test_argmax_rows_refuses_bad_input() -> None:
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        argmax_rows(torch.randn(2, 8).half())
    with pytest.raises(RuntimeError, match="int64"):
        ops.argmax_rows(torch.empty(2, dtype=torch.int32), torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="V must be"):
        argmax_rows(torch.randn(2, 0))


def small_llama(
    dtype: torch.dtype, hidden: int = 80, intermediate: int = 168, heads: int = 6, mlp_bias: bool = False
) -> LlamaForCausalLM:
    """A 2-layer random Llama (head_dim 16, 2 KV heads), norm weights near 1."""
    config = LlamaConfig(
        model_type="llama", hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=2, head_dim=16, rms_norm_eps=EPS, rope_theta=10000.0,
        rope_scaling=None, vocab_size=300, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
        mlp_bias=mlp_bias, max_position_embeddings=256, sliding_window=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            nn.init.normal_(p, std=0.2)
        for m in model.modules():
            if hasattr(m, "eps"):
                m.weight.add_(1.0)  # norm weights near 1
    model.reset_rope(dtype=dtype, device="cpu")
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_step_with_fused_ops_matches_torch_ops(dtype: torch.dtype) -> None:
    model = small_llama(dtype)
    block_size, num_blocks = 4, 24
    # seq 0: fresh 9-token prefill; seq 1: 5-token chunk after 6 cached; seqs 2, 3: decodes.
    query_lens, seq_lens = [9, 5, 1, 1], [9, 11, 7, 13]
    tables = [[3, 7, 1], [0, 9, 2], [11, 4], [5, 6, 8, 10]]
    meta_args = (query_lens, seq_lens, tables, block_size)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 300, (sum(query_lens),), generator=g)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)])
    shape = (2, num_blocks, block_size, 2, 16)
    cached = torch.randn(shape, generator=g).to(dtype)
    used = {b for t in tables for b in t}
    cached[:, [b for b in range(num_blocks) if b not in used]] = float("nan")  # an unused block read poisons

    def logits() -> tuple[torch.Tensor, list[torch.Tensor]]:
        caches = [cached.clone() for _ in range(2)]
        meta = AttentionMetadata.build(*meta_args)
        with torch.inference_mode():
            hidden = model(ids, positions, caches, meta, TorchPagedAttention())
            return model.compute_logits(hidden), caches

    assert not model.use_fused_ops(None)
    want, want_caches = logits()
    assert model.use_fused_ops(ops)
    got, got_caches = logits()
    assert torch.isfinite(want).all()
    for a, b in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=1e-5, atol=1e-5)
    if dtype == torch.bfloat16:
        # Every op rounds like torch's; exp's last-ulp differences may flip a bf16 rounding rarely.
        torch.testing.assert_close(got, want, rtol=0.0, atol=0.02)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_use_fused_ops_declines_other_dtypes() -> None:
    model = small_llama(torch.float32).half()
    assert not model.use_fused_ops(ops)
    assert all(getattr(m, "fused", None) is None for m in model.modules())
