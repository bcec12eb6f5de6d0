"""A deterministic stand-in for ``AsyncEngine`` (same interface, no model).

It streams ``1000 + ...`` token ids with a small ``asyncio.sleep`` per step,
keeps a per-request block count ("in use" while running), pins a session's
tokens when a request of that session ends, and records everything the
server asked of it so tests can assert on it from the test thread.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import math
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.errors import EngineError
from streamkv.metrics import EngineMetrics
from streamkv.outputs import CompletionDelta, RequestOutput, Usage
from streamkv.sampling_params import SamplingParams

BOS, EOS, USER, ASSISTANT, SYSTEM = 1, 2, 3, 4, 5


def encode(text: str) -> list[int]:
    return [100 + b for b in text.encode()]


class FakeChat:
    """A toy chat template over byte tokens (ids 100..355)."""

    def first_turn(self, user: str, system: str | None = None) -> list[int]:
        ids = [BOS]
        if system:
            ids += [SYSTEM, *encode(system), EOS]
        return [*ids, USER, *encode(user), EOS, ASSISTANT]

    def next_turn(self, user: str, last_finished_on_eos: bool) -> list[int]:
        return [*(() if last_finished_on_eos else (EOS,)), USER, *encode(user), EOS, ASSISTANT]


def token_at(prompt_len: int, step: int, index: int) -> int:
    return 1000 + (prompt_len + 31 * step + 7 * index) % 1000


def token_text(token_id: int) -> str:
    return "" if token_id == EOS else f" w{token_id}"


@dataclass(slots=True)
class FakeRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    session_id: str | None
    status: str = "running"  # running | finished | aborted
    output_ids: list[list[int]] = field(default_factory=list)
    num_blocks: int = 0


class FakeEngine:
    """Implements the AsyncEngine interface the server codes against."""

    def __init__(
        self,
        *,
        max_model_len: int = 2048,
        num_blocks: int = 512,
        block_size: int = 16,
        token_delay: float = 0.002,
        stop_after: int | None = None,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.config = EngineConfig(
            model=ModelConfig(model="fake-model"),
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
            scheduler=SchedulerConfig(max_model_len=max_model_len),
        )
        self.tokenizer = None
        self.model_name = "fake-model"
        self.load_seconds, self.load_source = 0.5, "folder"
        self.error: BaseException | None = None
        self.stalled = False
        self.chat = FakeChat()
        self.max_model_len = max_model_len
        self.eos_token_ids: tuple[int, ...] = (EOS,)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.token_delay = token_delay
        self.stop_after = stop_after  # emit EOS as the N-th token of every sample (finish "stop")
        self.metrics = metrics
        self.started = False
        self.start_calls = 0
        self.shutdown_calls = 0
        self.requests: list[FakeRequest] = []
        self.pins: dict[str, list[int]] = {}
        self.released: list[str] = []
        self.finished = {"stop": 0, "length": 0, "cancelled": 0}
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0}
        self.snapshot_calls = 0
        self.snapshot_calls_by_session: dict[str | None, int] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    # ---------------------------------------------------------- inspection

    @property
    def blocks_in_use(self) -> int:
        with self._lock:
            return sum(r.num_blocks for r in self.requests if r.status == "running")

    @property
    def aborted(self) -> list[FakeRequest]:
        return [r for r in self.requests if r.status == "aborted"]

    @property
    def pinned_blocks(self) -> int:
        with self._lock:
            return sum(self._blocks(len(t)) for t in self.pins.values())

    # ----------------------------------------------------------- interface

    async def start(self) -> None:
        self.start_calls += 1
        self.started = True

    async def shutdown(self) -> None:
        self.shutdown_calls += 1
        self.started = False

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        prompt = list(prompt_token_ids)
        max_tokens = self._admit(prompt, params)
        req = FakeRequest(request_id or f"req-{next(self._ids)}", prompt, params, session_id)
        req.output_ids = [[] for _ in range(params.n)]
        pinned = self.pins.get(session_id, []) if session_id else []
        cached = len(pinned) if pinned and prompt[: len(pinned)] == pinned and len(pinned) < len(prompt) else 0
        with self._lock:
            req.num_blocks = self._blocks(len(prompt))
            self.requests.append(req)
            self.counters["prompt_tokens"] += len(prompt)
        arrival = time.perf_counter()
        ttft: float | None = None
        live = set(range(params.n))
        try:
            for step in range(max_tokens):
                await asyncio.sleep(self.token_delay)
                deltas = []
                for i in sorted(live):
                    tok = token_at(len(prompt), step, i)
                    reason = None
                    if self.stop_after is not None and step + 1 >= self.stop_after:
                        tok, reason = EOS, "stop"
                    elif step + 1 == max_tokens:
                        reason = "length"
                    req.output_ids[i].append(tok)
                    deltas.append(CompletionDelta(i, [tok], token_text(tok), reason))
                    if reason is not None:
                        live.discard(i)
                with self._lock:
                    req.num_blocks = self._blocks(len(prompt) + max(len(o) for o in req.output_ids))
                    self.counters["generation_tokens"] += len(deltas)
                if ttft is None:
                    ttft = time.perf_counter() - arrival
                    if self.metrics:
                        self.metrics.observe_first_token(ttft)
                elif self.metrics:
                    self.metrics.observe_inter_token(self.token_delay)
                if not live:
                    final_reason = deltas[0].finish_reason or "stop"
                    self._end(req, "finished", final_reason)
                    num_out = sum(len(o) for o in req.output_ids)
                    e2e = time.perf_counter() - arrival
                    if self.metrics:
                        self.metrics.observe_finished(e2e, len(prompt), num_out, final_reason)
                    yield RequestOutput(req.request_id, deltas, True, Usage(len(prompt), cached, num_out), ttft, e2e)
                    return
                yield RequestOutput(req.request_id, deltas, ttft_s=ttft)
        finally:
            if req.status == "running":  # aclose() or the consumer was cancelled
                self._end(req, "aborted", "cancelled")

    keeps_sessions = False

    def saved_sessions(self) -> list[tuple[str, list[int]]]:
        return []

    def release_session(self, session_id: str) -> None:
        with self._lock:
            self.pins.pop(session_id, None)
            self.released.append(session_id)

    def snapshot(self, session_id: str | None = None, include_blocks: bool = True) -> dict[str, Any]:
        with self._lock:
            self.snapshot_calls += 1
            self.snapshot_calls_by_session[session_id] = self.snapshot_calls_by_session.get(session_id, 0) + 1
            used = sum(r.num_blocks for r in self.requests if r.status == "running")
            pins = {sid: self._blocks(len(t)) for sid, t in self.pins.items()}
            running = sum(r.status == "running" for r in self.requests)
            finished = dict(self.finished)
            counters = dict(self.counters)
        pinned = sum(pins.values())
        free = max(self.num_blocks - used - pinned, 0)
        snap: dict[str, Any] = {
            "t": time.time(),
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "state_names": ["free", "cached", "used", "pinned", "shared"],
            "counts": {"free": free, "cached": 0, "used": used, "pinned": pinned, "shared": 0},
            "kv_usage": (used + pinned) / self.num_blocks,
            "requests": {"running": running, "waiting": 0, "swapped": 0},
            "sessions": {"active": len(pins), "pinned_blocks": pinned},
            "counters": {
                **counters,
                "prefix_cache_queries": 0,
                "prefix_cache_hits": 0,
                "preemptions": 0,
                "preemptions_recompute": 0,
                "preemptions_swap": 0,
                "evictions": 0,
                "cow_copies": 0,
                "swapped_out_blocks": 0,
                "computed_prompt_tokens": counters["prompt_tokens"],
            },
            "finished": finished,
            "tokens_per_s": 0.0,
        }
        if include_blocks:
            states = bytearray(self.num_blocks)
            states[:used] = b"\x02" * min(used, self.num_blocks)
            states[used : used + pinned] = b"\x03" * max(min(pinned, self.num_blocks - used), 0)
            snap["states"] = base64.b64encode(bytes(states)).decode()
            next_block, session_blocks = used, {}
            for sid, n in pins.items():
                if sid == session_id:
                    session_blocks[sid] = list(range(next_block, next_block + n))
                next_block += n
            snap["session_blocks"] = session_blocks
        return snap

    # ----------------------------------------------------------- internals

    def _blocks(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _admit(self, prompt: list[int], params: SamplingParams) -> int:
        if not self.started:
            raise EngineError("engine_stopped", "the engine is not running")
        if not prompt:
            raise EngineError("empty_prompt", "the prompt is empty")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt)
        if len(prompt) + max_tokens > self.max_model_len:
            raise EngineError(
                "prompt_too_long",
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len {self.max_model_len}",
            )
        if self._blocks(len(prompt) + max_tokens) > self.num_blocks:
            raise EngineError("exceeds_pool", "the request can never fit the KV pool")
        return max_tokens

    def _end(self, req: FakeRequest, status: str, reason: str) -> None:
        with self._lock:
            req.status = status
            req.num_blocks = 0
            self.finished[reason] += 1
            if req.session_id is not None:
                self.pins[req.session_id] = req.prompt_ids + req.output_ids[0]
