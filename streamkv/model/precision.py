"""Which dtype ``--dtype auto`` means on this machine.

vLLM's rule, adapted to the CPU: bf16 where the hardware computes it natively
(CPUs with AVX512-BF16 or AMX-BF16, where oneDNN's bf16 matmuls run at about
twice the fp32 rate and the KV cache halves; GPUs with bf16 support), else
float32 on the CPU and float16 on older GPUs. fp32 stays the exact
reference: every exactness test pins it.
"""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The CPU's feature flags as Linux names them (``avx512f``, ``avx512_bf16``, ``amx_bf16``, ...).

    Args:
        cpuinfo: text in ``/proc/cpuinfo``'s format; read from there when
            ``None``.

    Returns:
        The union of every ``flags`` line, or ``None`` where ``/proc/cpuinfo``
        cannot be read (not Linux).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags.update(value.split())
    return frozenset(flags)


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU has native bf16 arithmetic (``avx512_bf16`` or ``amx_bf16`` in its flags).

    Args:
        cpuinfo: text in ``/proc/cpuinfo``'s format; read from there when
            ``None``. Without it (not Linux), torch's own CPU probe answers.
    """
    flags = cpu_flags(cpuinfo)
    if flags is None:
        probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
        return bool(probe()) if probe is not None else False
    return not BF16_CPU_FLAGS.isdisjoint(flags)


def onednn_has_bf16() -> bool:
    """True when oneDNN runs bf16 matmuls on this CPU (torch's probe: AVX-512 BW/VL/DQ or newer).

    Without them (an AVX2-only CPU) ``--dtype bfloat16`` runs on torch's
    default matmuls, and ``--quantization int8`` with bf16 activations is
    refused at load.
    """
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None and torch.backends.mkldnn.is_available() else False


def emulated_bf16_warning(
    dtype: torch.dtype, device: torch.device, quantization: str | None = None, cpuinfo: str | None = None
) -> str | None:
    """What to tell a user who asked for bf16 on a CPU that has no bf16 arithmetic; ``None`` otherwise.

    Without AVX512-BF16 or AMX-BF16 oneDNN widens bf16 to fp32 for fp32 FMAs
    and the small-batch bf16 kernel is off, so the engine runs slower than in
    float32: on an Ice Lake host (AVX-512, no AVX512-BF16) bf16 gave 26.3 /
    68.7 / 100.5 / 87.9 output tok/s at batch 1 / 8 / 32 / 64 against
    float32's 77.5 / 245.0 / 299.7 / 311.2 in one run, 0.28-0.34x
    (docs/benchmarks.md, "Round 24"). ``--dtype auto`` picks float32 there.
    With ``--quantization int8`` the int8 kernel takes bf16 rows on any VNNI
    CPU, so nothing is said (that mix is not measured here).

    Args:
        dtype: the resolved model dtype.
        device: where the model runs.
        quantization: ``ModelConfig.quantization``.
        cpuinfo: as in :func:`cpu_has_bf16`.
    """
    if dtype != torch.bfloat16 or device.type != "cpu" or quantization is not None or cpu_has_bf16(cpuinfo):
        return None
    return (
        "bfloat16 on a CPU without AVX512-BF16 or AMX-BF16: bf16 matmuls are widened to fp32 and the "
        "small-batch kernels are off, so this runs at a quarter to a third of float32's speed "
        "(docs/benchmarks.md, 'Round 24'); --dtype auto picks float32 on this CPU"
    )


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype for ``--dtype name`` on ``device`` (``auto`` decided here).

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}, not {name!r}")
    return DTYPES[name]
