"""What the engine core reports as events happen (implemented by :class:`streamkv.metrics.EngineMetrics`)."""

from __future__ import annotations

from typing import Protocol

from streamkv.outputs import FinishReason


class MetricsHooks(Protocol):
    """Observers called on the engine thread; implementations must be cheap and thread-safe."""

    def observe_step(self, duration_s: float, num_scheduled_tokens: int) -> None: ...

    def observe_first_token(self, ttft_s: float) -> None: ...

    def observe_inter_token(self, itl_s: float) -> None: ...

    def observe_finished(
        self, e2e_s: float, prompt_tokens: int, generation_tokens: int, finish_reason: FinishReason
    ) -> None: ...

    def observe_stall(self) -> None: ...

    def observe_threads(self, threads: int, dropped: bool) -> None: ...

    def observe_greedy_head(self, rows: int, candidates: int, fell_back: bool) -> None: ...
