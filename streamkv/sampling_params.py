"""Per-request sampling parameters (OpenAI / vLLM names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # most top logprobs per token (vLLM's default max_logprobs, OpenAI's top_logprobs cap)
MAX_BEAM_WIDTH = 16  # as many beams as samples (``n``)

EarlyStopping = bool | Literal["never"]


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
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled before this
            many new tokens (vLLM's extension; stop strings still apply).
        logprobs: ``None`` returns no logprobs; ``k`` in 0..20 returns each
            sampled token's log-probability and the ``k`` likeliest
            alternatives (natural log, of the model's raw distribution,
            before temperature, top-k and top-p, as vLLM reports them).
        beam_width: ``None`` samples; ``k`` in 1..16 runs beam search with
            ``k`` beams (:mod:`streamkv.beam_search`) and returns the ``n``
            best hypotheses (``n <= k``), all at the end. Beam search scores
            the model's raw log-probabilities: ``temperature``, ``top_p``,
            ``top_k`` and ``seed`` do not apply; ``stop`` strings and
            ``logprobs`` are refused; EOS, ``stop_token_ids``,
            ``ignore_eos`` and ``min_tokens`` apply as for sampling.
        length_penalty: beam search ranks a hypothesis of ``L`` new tokens by
            ``sum logprob / L ** length_penalty`` (transformers' rule); finite.
        early_stopping: transformers' ``early_stopping``: ``True`` stops once
            ``beam_width`` hypotheses are finished; ``False`` (default) stops
            when the best running beam, scored at its current length, cannot
            beat the worst finished one; ``"never"`` scores it at
            ``max_tokens`` when ``length_penalty > 0``.

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
    min_tokens: int = 0
    logprobs: int | None = None
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False

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
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self._check_beam_search()

    def _check_beam_search(self) -> None:
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if self.beam_width is None:
            return
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in 1..{MAX_BEAM_WIDTH}, got {self.beam_width}")
        if self.n > self.beam_width:
            raise ValueError(f"n ({self.n}) must not exceed beam_width ({self.beam_width}): the n best are returned")
        if self.stop:
            raise ValueError("stop strings are not supported with beam_width (use stop_token_ids)")
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported with beam_width")

    @property
    def beam_search(self) -> bool:
        """Beam search (``beam_width`` set) rather than sampling."""
        return self.beam_width is not None

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 sample greedily (vLLM's ``_SAMPLING_EPS``): dividing by them overflows."""
        return self.temperature < _SAMPLING_EPS
