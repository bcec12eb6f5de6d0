"""``--dtype auto``: bf16 exactly where the CPU has native bf16, fp32 otherwise."""

from __future__ import annotations

import pytest
import torch

from streamkv.config import ModelConfig
from streamkv.model import precision
from streamkv.model.precision import cpu_has_bf16, resolve_dtype

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
