"""Rotary position embeddings (GPT-NeoX / transformers half-split layout), with llama3 and linear scaling."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from streamkv.model.mkl_vml import resolve_vml_dispatch

logger = logging.getLogger(__name__)

# oneMKL's high-accuracy cos/sin are under 1 ulp, so within 2**-23 of the exact value where |x| <= 1; its
# low-accuracy kernel is thousands of ulp off (streamkv.model.mkl_vml).
TABLE_TOLERANCE = 2.0**-22


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3.1 style frequency scaling (``rope_type: llama3``) or plain ``linear``.

    Attributes:
        rope_type: ``llama3`` or ``linear``.
        factor: how much longer the context is than in pretraining.
        low_freq_factor, high_freq_factor: llama3 band edges (wavelength divisors).
        original_max_position_embeddings: pretraining context of llama3 scaling.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's halves: ``x * cos + rotate_half(x) * sin`` (GPT-NeoX / HF layout).

    ``rotate_half([x1, x2]) = [-x2, x1]``; the sign lives in ``sin``'s table
    (``[-sin, sin]``), so the rotation is a swap of the halves.

    Args:
        x: ``[T, H, D]``, any strides with a unit last stride.
        cos: ``[T, 1, D]`` rows of :func:`rope_tables`' ``cos``.
        sin: ``[T, 1, D]`` rows of its signed ``sin``.

    Returns:
        ``[T, H, D]`` contiguous.
    """
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
    return torch.addcmul(x * cos, swapped, sin)


class RopeConfig(Protocol):
    """What RoPE reads of a model config (``LlamaConfig`` has these)."""

    @property
    def head_dim(self) -> int: ...

    @property
    def rope_theta(self) -> float: ...

    @property
    def rope_scaling(self) -> RopeScaling | None: ...


def rope_tables(config: RopeConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Precompute RoPE tables for positions ``0 .. max_positions-1``.

    The angles are ``position * inv_freq`` in float32, and their cos and sin
    float32 too, exactly as transformers computes them (``inv_freq = theta **
    (-2i / D)``, optionally rescaled), so the tables are bitwise its own.
    Each of cos and sin is checked against float64 (:func:`_checked_unary`).

    Returns:
        ``(cos, sin)``, float32 ``[max_positions, D]``: ``cos = [c, c]`` and
        ``sin = [-s, s]`` for the half-split rotation of :func:`apply_rope`.
    """
    resolve_vml_dispatch()
    inv_freq = rope_inv_freq(config)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
    cos, sin = _checked_unary(angles, "cos"), _checked_unary(angles, "sin")
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def _checked_unary(x: torch.Tensor, op: str) -> torch.Tensor:
    """``x.<op>()`` for float32 ``x``, within :data:`TABLE_TOLERANCE` of its float64 value.

    A call that is off (what oneMKL's dispatch race gives, streamkv.model.mkl_vml) is made once more, as the
    next call is right; if that one is off too, the float64 values rounded to float32 are used instead (no
    longer transformers' bits, but within half an ulp). Each step logs a warning.
    """
    values: torch.Tensor = getattr(x, op)()
    for attempt in (1, 2):
        error = _max_error(x, values, op)
        if error <= TABLE_TOLERANCE:
            return values
        logger.warning("torch.%s was %.3g off its float64 value in a RoPE table (try %d of 2)", op, error, attempt)
        values = getattr(x, op)() if attempt == 1 else getattr(x.double(), op)().float()
    logger.warning("the RoPE table's %s is float64's, rounded to float32", op)
    return values


def _max_error(x: torch.Tensor, values: torch.Tensor, op: str, rows: int = 1 << 14) -> float:
    """``max |values - op(float64 x)|`` over row slices of ``rows``, so float64 copies stay a few MB."""
    error = 0.0
    for i in range(0, x.shape[0], rows):
        exact = getattr(x[i : i + rows].double(), op)()
        error = max(error, float(exact.sub_(values[i : i + rows]).abs_().max())) if exact.numel() else error
    return error


def rope_inv_freq(config: RopeConfig) -> torch.Tensor:
    """float32 ``[D/2]`` inverse frequencies, with llama3 / linear scaling applied.

    Source: transformers ``modeling_rope_utils`` (``_compute_default_rope_parameters``,
    ``_compute_linear_scaling_rope_parameters``, ``_compute_llama3_parameters``).
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def read_rope(hf_config: Any) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``.

    Raises:
        ValueError: a scaling type other than default, linear or llama3.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if legacy and not params.get("factor"):
        params = {**params, **legacy}
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        return float(theta), RopeScaling("linear", float(params["factor"]))
    if rope_type == "llama3":
        return float(theta), RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params.get("original_max_position_embeddings") or hf_config.max_position_embeddings),
        )
    raise ValueError(f"unsupported RoPE scaling type {rope_type!r}; supported: default, linear, llama3")
