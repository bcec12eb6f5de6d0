"""What the server needs from the engine: a structural type of ``AsyncEngine``.

The server imports this, never ``streamkv.engine`` (which loads torch), so
the front end can be tested against a fake and ``streamkv --help`` stays fast.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from streamkv.config import EngineConfig
from streamkv.outputs import RequestOutput
from streamkv.sampling_params import SamplingParams


class ChatFormatterLike(Protocol):
    def first_turn(self, user: str, system: str | None = None) -> list[int]: ...

    def next_turn(self, user: str, last_finished_on_eos: bool) -> list[int]: ...

    def next_messages(self, messages: list[dict[str, str]], last_finished_on_eos: bool) -> list[int]: ...


class ServingEngine(Protocol):
    # Read-only members (properties), so that plain attributes of any subtype satisfy them.
    @property
    def config(self) -> EngineConfig: ...

    @property
    def chat(self) -> ChatFormatterLike: ...

    @property
    def model_name(self) -> str: ...

    @property
    def error(self) -> BaseException | None:
        """Why the engine thread died (then ``/healthz`` answers 503); ``None`` while healthy."""
        ...

    @property
    def stalled(self) -> bool:
        """The watchdog saw steps run without progress (then ``/healthz`` says ``degraded``)."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    def release_session(self, session_id: str) -> None: ...
    def saved_sessions(self) -> list[tuple[str, list[int]]]:
        """``(session_id, history)`` saved before a restart (``--kv-offload-dir``); else empty."""
        ...
    @property
    def keeps_sessions(self) -> bool:
        """Idle sessions outlive a shutdown: the server does not release them then."""
        ...

    def snapshot(self, session_id: str | None = None, include_blocks: bool = True) -> dict[str, Any]: ...
