"""The RoPE tables: torch's own float32 cos and sin, checked against float64, computed again when a call was off."""

from __future__ import annotations

import logging
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


def test_two_off_calls_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.Tensor, "cos", off_on_calls({0, 1}))
    with pytest.raises(RuntimeError, match=r"torch\.cos is 0\.0001 off its float64 value"):
        rope.rope_tables(Config(), 2048)


def test_every_vml_function_is_resolved_on_one_element_before_the_first_table(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[torch.dtype, int]] = []
    for owner in (torch, torch.Tensor):
        real = owner.cos
        monkeypatch.setattr(owner, "cos", lambda x, real=real: (calls.append((x.dtype, x.numel())), real(x))[1])
    mkl_vml.resolve_vml_dispatch.cache_clear()
    rope.rope_tables(Config(head_dim=8), 64)
    assert calls == [(torch.float32, 1), (torch.float64, 1), (torch.float64, 256), (torch.float32, 256)]
    assert all(callable(getattr(torch, op)) for op in mkl_vml.VML_OPS)
