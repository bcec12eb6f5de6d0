"""The RoPE tables: torch's own float32 cos and sin, checked against float64, computed again when a call is off."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from streamkv.model import mkl_vml, rope


@dataclass(frozen=True)
class Config:
    head_dim: int = 64
    rope_theta: float = 100000.0
    rope_scaling: rope.RopeScaling | None = None


def off_on_calls(bad_calls: set[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A ``Tensor.cos`` whose float32 calls numbered in ``bad_calls`` (from 0) come back 1e-4 off, as VML_EP's."""
    real = torch.Tensor.cos
    calls = [0]

    def cos(x: torch.Tensor) -> torch.Tensor:
        values = real(x)
        if x.dtype != torch.float32:
            return values
        calls[0] += 1
        return values + 1e-4 if calls[0] - 1 in bad_calls else values

    return cos


def test_the_tables_are_torchs_float32_cos_and_sin() -> None:
    cos, sin = rope.rope_tables(Config(), 4096)
    angles = torch.outer(torch.arange(4096, dtype=torch.float32), rope.rope_inv_freq(Config()))
    assert torch.equal(cos, torch.cat([angles.cos(), angles.cos()], -1))
    assert torch.equal(sin, torch.cat([-angles.sin(), angles.sin()], -1))
    assert float((cos[:, :32].double() - angles.double().cos()).abs().max()) <= rope.TABLE_TOLERANCE


def test_an_off_call_is_made_again(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    expected, _ = rope.rope_tables(Config(), 2048)
    monkeypatch.setattr(torch.Tensor, "cos", off_on_calls({0}))
    with caplog.at_level(logging.WARNING, logger="streamkv.model.rope"):
        cos, _ = rope.rope_tables(Config(), 2048)
    assert torch.equal(cos, expected)
    assert "torch.cos was 0.0001 off its float64 value in a RoPE table (try 1 of 2)" in caplog.text


def test_two_off_calls_give_the_float64_values_rounded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    angles = torch.outer(torch.arange(2048, dtype=torch.float32), rope.rope_inv_freq(Config()))
    monkeypatch.setattr(torch.Tensor, "cos", off_on_calls({0, 1}))
    with caplog.at_level(logging.WARNING, logger="streamkv.model.rope"):
        cos, _ = rope.rope_tables(Config(), 2048)
    assert torch.equal(cos[:, :32], angles.double().cos().float())
    assert "(try 2 of 2)" in caplog.text and "the RoPE table's cos is float64's, rounded to float32" in caplog.text


def test_a_long_llama3_table_passes_its_check(caplog: pytest.LogCaptureFixture) -> None:
    """131,072 positions of Llama 3.1's scaling (angles up to ~1.3e5 rad): torch's cos and sin stay in tolerance."""
    config = Config(head_dim=128, rope_theta=500000.0, rope_scaling=rope.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
    with caplog.at_level(logging.WARNING, logger="streamkv.model.rope"):
        cos, sin = rope.rope_tables(config, 131072)
    assert cos.shape == sin.shape == (131072, 128)
    assert "RoPE table" not in caplog.text


def test_every_vml_op_runs_on_one_element_in_both_dtypes_before_the_first_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, torch.dtype, int]] = []

    def spy(name: str, real: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: (calls.append((name, x.dtype, x.numel())), real(x))[1]

    for op in mkl_vml.VML_OPS:
        monkeypatch.setattr(torch, op, spy(op, getattr(torch, op)))
    monkeypatch.setattr(torch.Tensor, "cos", spy("Tensor.cos", torch.Tensor.cos))
    mkl_vml.resolve_vml_dispatch.cache_clear()
    rope.rope_tables(Config(head_dim=8), 64)
    warm = Counter((op, dtype, 1) for op in mkl_vml.VML_OPS for dtype in (torch.float32, torch.float64))
    assert Counter(calls[: len(warm)]) == warm
    assert calls[len(warm) :] == [("Tensor.cos", torch.float32, 256), ("Tensor.cos", torch.float64, 256)]
