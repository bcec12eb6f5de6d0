"""What the engine hands back: streamed deltas and finished requests."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from streamkv.errors import EngineError


class FinishReason(enum.StrEnum):
    """Why a sample ended (the ``finish_reason`` of deltas, done frames and metrics labels)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    CANCELLED = "cancelled"  # aborted by the client, a closed socket or shutdown


@dataclass(slots=True)
class Usage:
    """Token accounting of one request (all samples together for completion)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one sampled token (natural log, the model's raw distribution).

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability.
        top: the ``SamplingParams.logprobs`` likeliest tokens as ``(token_id, logprob)``, likeliest first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class CompletionDelta:
    """New output of one sample since the previous delta.

    ``text`` may be empty while characters are held back (a possible stop
    string prefix or an incomplete UTF-8 sequence); the concatenation of all
    deltas' text is the final text.
    """

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when SamplingParams.logprobs is set
    score: float | None = None  # beam search: the hypothesis' length-penalized log-probability


@dataclass(slots=True)
class CompletionOutput:
    """The whole output of one sample (offline API)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    score: float | None = None  # beam search: the hypothesis' length-penalized log-probability


@dataclass(slots=True)
class RequestOutput:
    """One update of a request: the deltas of this step, and, once finished, totals.

    Attributes:
        request_id: the request this belongs to.
        deltas: per-sample news of this engine step (possibly several steps
            coalesced when the consumer was slow).
        finished: all samples are done.
        usage: set when finished.
        ttft_s: seconds from arrival to the first token (set once known).
        e2e_s: seconds from arrival to finish (set when finished).
        num_cached_tokens: prompt tokens served from the prefix cache or the
            session's pin (on every output, so a consumer that stops reading
            early still knows it).
    """

    request_id: str
    deltas: list[CompletionDelta]
    finished: bool = False
    usage: Usage | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_cached_tokens: int | None = None


@dataclass(slots=True)
class CompletedRequest:
    """A finished request as the offline API returns it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    usage: Usage | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None


RequestSink = Callable[[RequestOutput | EngineError], None]
"""Where a request's outputs go, called on the engine thread: every :class:`RequestOutput`
(the last has ``finished=True``), or one :class:`EngineError` when the engine fails it."""
