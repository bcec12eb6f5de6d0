"""Per-request sampling parameters (OpenAI / vLLM names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_SAMPLING_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request.

    Attributes:
        n: independent samples of the same prompt (share the prompt's blocks).
        max_tokens: most new tokens per sample; ``None`` = up to max_model_len.
        temperature: 0 (or anything below 1e-5) means greedy; finite.
        top_p: nucleus mass in (0, 1]; finite.
        top_k: keep the k most likely tokens; ``None`` keeps all.
        seed: per-request RNG seed; the same seed gives the same tokens
            regardless of batch mix or preemption.
        stop: strings that end generation; the stop string is not returned.
        stop_token_ids: extra token ids that end generation.
        ignore_eos: keep generating past EOS (benchmarks).

    Raises:
        ValueError: on out-of-range or non-finite (NaN, inf) values (the
            message names the field).
    """

    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not 1 <= self.n <= 16:
            raise ValueError(f"n must be in 1..16, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not math.isfinite(value):  # NaN slips through every comparison below
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be None (all) or >= 1, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 sample greedily (vLLM's ``_SAMPLING_EPS``): dividing by them overflows."""
        return self.temperature < _SAMPLING_EPS
