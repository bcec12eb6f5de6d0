"""``--dtype auto``: bf16 exactly where the CPU has native bf16, fp32 otherwise; bf16 asked for elsewhere is
warned of."""

from __future__ import annotations

import logging

import pytest
import torch

from streamkv.config import ModelConfig
from streamkv.model import precision
from streamkv.model.loader import load_model
from streamkv.model.precision import cpu_has_bf16, emulated_bf16_warning, resolve_dtype

EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
XEON_AMX = "flags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n"
OLD = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\nbugs\t\t: avx512_bf16_is_not_a_flag_here\n"


def test_cpu_flags_decide() -> None:
    assert cpu_has_bf16(EPYC)
    assert cpu_has_bf16(XEON_AMX)
    assert not cpu_has_bf16(OLD)  # only the "flags" line counts
    assert not cpu_has_bf16("")


def test_auto_on_cpu_follows_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) == torch.float32


def test_explicit_names_and_errors() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("fp8", cpu)
    assert ModelConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype must be auto"):
        ModelConfig(dtype="int4")


def test_bf16_on_a_cpu_without_bf16_arithmetic_is_warned_of() -> None:
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    warning = emulated_bf16_warning(bf16, cpu, cpuinfo=OLD)
    assert warning is not None and "float32" in warning and "AVX512-BF16" in warning
    assert emulated_bf16_warning(bf16, cpu, cpuinfo=EPYC) is None
    assert emulated_bf16_warning(bf16, cpu, cpuinfo=XEON_AMX) is None
    assert emulated_bf16_warning(torch.float32, cpu, cpuinfo=OLD) is None
    assert emulated_bf16_warning(bf16, torch.device("cuda"), cpuinfo=OLD) is None  # a GPU's bf16 is its own
    assert emulated_bf16_warning(bf16, cpu, "int8", cpuinfo=OLD) is None  # the int8 kernel takes bf16 rows anyway


def test_loading_in_bf16_there_logs_the_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tiny_model_dir: str
) -> None:
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda cpuinfo=None: False)
    with caplog.at_level(logging.WARNING, logger="streamkv.model.loader"):
        loaded = load_model(ModelConfig(model=tiny_model_dir, dtype="bfloat16", device="cpu"), torch.device("cpu"))
    assert loaded.dtype == torch.bfloat16  # the user's choice stands; the log says what it costs
    assert "a quarter to a third of float32's speed" in caplog.text
