"""Prometheus metrics of one engine, in its own registry (never the global one).

Two sources, one truth each:

- **Events** (latencies, per-request sizes, errors) are observed as they
  happen into histograms and counters owned here. The ``observe_*`` methods
  are called from the engine thread; prometheus_client metrics are
  thread-safe.
- **State and totals the engine already counts** (running requests, block
  states, token counters, preemptions, ...) are read at scrape time from
  ``snapshot_fn()`` (``AsyncEngine.snapshot(include_blocks=False)``) by a
  custom collector, so a number is never counted twice in two places.

Names follow vLLM's (``vllm:`` -> ``streamkv_``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from streamkv.config import PreemptionMode
from streamkv.errors import ErrorCode
from streamkv.outputs import FinishReason

if TYPE_CHECKING:
    from streamkv.gc_control import CollectionTimer

logger = logging.getLogger(__name__)

# ``*_created`` series (one per counter and histogram, holding a timestamp) only
# double the exposition; vLLM turns them off too. Process-wide in prometheus-client.
disable_created_metrics()

SnapshotFn = Callable[[], Mapping[str, Any]]

# Seconds; spans a GPU decode step (~1 ms) to a long CPU answer (60 s).
# fmt: off
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
)
LOOP_LAG_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)
# fmt: on
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(1 << i) for i in range(16))  # 1 .. 32768

BLOCK_STATES: tuple[str, ...] = ("free", "cached", "used", "pinned", "shared")
FINISH_REASONS: tuple[FinishReason, ...] = tuple(FinishReason)
LIMITS: tuple[str, ...] = ("max_connections", "idle_timeout", "max_stop_strings", "max_stop_string_length")
# Pre-created so dashboards see zeros before the first error.
KNOWN_ERROR_CODES: tuple[ErrorCode, ...] = tuple(ErrorCode)


class EngineMetrics:
    """Histograms and counters of one engine plus a scrape-time snapshot collector.

    Usage: construct, hand to the engine (it calls ``observe_*``), then
    ``attach(lambda: engine.snapshot(include_blocks=False))`` and serve
    ``render()`` at ``/metrics``.

    Args:
        const_labels: labels added to every series at render time (Ray Serve's
            replicas pass ``{"replica": name}``); none by default, so a single
            process exports exactly the names and labels documented in the README.
    """

    def __init__(self, const_labels: Mapping[str, str] | None = None) -> None:
        self.const_labels = dict(const_labels or {})
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.time_to_first_token = Histogram(
            "streamkv_time_to_first_token_seconds",
            "Arrival to first output token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "streamkv_inter_token_latency_seconds",
            "Time between consecutive output tokens of a sample.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "streamkv_e2e_request_latency_seconds",
            "Arrival to finish, by finish reason.",
            ["finished_reason"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "streamkv_request_prompt_tokens", "Prompt length of finished requests.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.request_generation_tokens = Histogram(
            "streamkv_request_generation_tokens",
            "Generated tokens of finished requests (all samples).",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.step_num_scheduled_tokens = Histogram(
            "streamkv_step_num_scheduled_tokens",
            "Tokens scheduled in one engine step.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.step_duration = Histogram(
            "streamkv_step_duration_seconds", "Wall time of one engine step.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.event_loop_lag = Histogram(
            "streamkv_event_loop_lag_seconds",
            "Overshoot of a timed asyncio sleep on the server loop.",
            buckets=LOOP_LAG_BUCKETS,
            registry=r,
        )
        self.gc_pause = Histogram(
            "streamkv_gc_pause_seconds",
            "Python garbage collections of the server process, by generation; each holds the GIL, so the engine "
            "thread waits it out.",
            ["generation"],
            buckets=LOOP_LAG_BUCKETS,
            registry=r,
        )
        self.gc_pauses_dropped = Counter(
            "streamkv_gc_pauses_dropped",
            "Garbage collections whose pause was not timed: more came between two scrapes than the timer keeps "
            "(gc_control.CollectionTimer's max_pending).",
            registry=r,
        )
        self.engine_stalls = Counter(
            "streamkv_engine_stalls",
            "Times the engine ran steps with work queued but no token computed and no request finished.",
            registry=r,
        )
        self.engine_threads = Gauge(
            "streamkv_engine_threads",
            "torch threads the engine thread runs its steps on now (fewer than --threads while other work competes "
            "for the cores; streamkv/thread_governor.py).",
            registry=r,
        )
        self.engine_thread_drops = Counter(
            "streamkv_engine_thread_drops",
            "Times the engine dropped to one torch thread because its thread waited for a core.",
            registry=r,
        )
        self.greedy_head_rows = Counter(
            "streamkv_greedy_head_rows",
            "Greedy rows whose token came from the float32 greedy head (a bf16 estimate of the LM head and exact "
            "fp32 candidates; streamkv/model/greedy_head.py) instead of the full logits.",
            registry=r,
        )
        self.greedy_head_candidates = Counter(
            "streamkv_greedy_head_candidates",
            "Exact fp32 logits the greedy head computed for those rows, its cost: candidates / rows is the mean a row "
            "(3-6 on SmolLM2; the median row needs 1).",
            registry=r,
        )
        self.greedy_head_fallbacks = Counter(
            "streamkv_greedy_head_fallbacks",
            "Steps (not rows) the greedy head handed back to the full logits: a non-finite hidden row or estimate.",
            registry=r,
        )
        self.errors = Counter("streamkv_errors", "Error frames sent to clients, by code.", ["code"], registry=r)
        for code in KNOWN_ERROR_CODES:
            self.errors.labels(code=code)
        for reason in FINISH_REASONS:
            self.e2e_request_latency.labels(finished_reason=reason)
        # the server's own bounds (streamkv/server/limits.py, origin.py)
        self.open_connections = Gauge(
            "streamkv_open_connections", "Open WebSockets and HTTP requests in flight.", ["kind"], registry=r
        )
        self.limit_refusals = Counter(
            "streamkv_limit_refusals", "Connections and requests refused or closed by a limit.", ["limit"], registry=r
        )
        self.rejected_origins = Counter(
            "streamkv_rejected_origins", "WebSocket handshakes refused by the Origin check.", registry=r
        )
        self.chat_sessions = Gauge(
            "streamkv_chat_sessions",
            "Live chat sessions: attached to a socket, or resumable (detached, until --session-ttl).",
            ["state"],
            registry=r,
        )
        # the Responses API (server/responses/)
        self.responses_stored = Counter(
            "streamkv_responses_stored", "Responses kept for previous_response_id (store: true or false).", registry=r
        )
        self.chains_forked = Counter(
            "streamkv_chains_forked", "Responses that forked a new chain off an older or busy response.", registry=r
        )
        self.previous_response_not_found = Counter(
            "streamkv_previous_response_not_found",
            "Responses refused: previous_response_id unknown, expired or another connection's.",
            registry=r,
        )
        for generation in ("0", "1", "2"):
            self.gc_pause.labels(generation=generation)
        for kind in ("http", "websocket"):
            self.open_connections.labels(kind=kind)
        for state in ("attached", "resumable"):
            self.chat_sessions.labels(state=state)
        for limit in LIMITS:
            self.limit_refusals.labels(limit=limit)
        self._snapshot_collector = _SnapshotCollector()
        r.register(self._snapshot_collector)
        self._gc_timer: CollectionTimer | None = None
        self._gc_dropped_seen = 0  # the timer's `dropped` already added to streamkv_gc_pauses_dropped
        self._gc_lock = threading.Lock()  # two scrapes may render at once

    # ------------------------------------------------------------ public API

    def attach_sessions(self, num_attached: Callable[[], int], num_detached: Callable[[], int]) -> None:
        """Read the chat session counts at each scrape: ``attached`` to a socket, ``resumable`` (detached)."""
        self.chat_sessions.labels(state="attached").set_function(num_attached)
        self.chat_sessions.labels(state="resumable").set_function(num_detached)

    def attach_gc_timer(self, timer: CollectionTimer | None) -> None:
        """Drain ``timer``'s collection pauses into ``streamkv_gc_pause_seconds`` at each scrape (None detaches)."""
        with self._gc_lock:
            if timer is not self._gc_timer:  # the same timer again keeps its count: its drops are not added twice
                self._gc_timer = timer
                self._gc_dropped_seen = 0

    def attach(self, snapshot_fn: SnapshotFn | None) -> None:
        """Read gauges and engine counters from ``snapshot_fn()`` at each scrape (None detaches)."""
        self._snapshot_collector.snapshot_fn = snapshot_fn

    def observe_step(self, duration_s: float, num_scheduled_tokens: int) -> None:
        if _finite(duration_s):
            self.step_duration.observe(max(duration_s, 0.0))
        self.step_num_scheduled_tokens.observe(max(num_scheduled_tokens, 0))

    def observe_first_token(self, ttft_s: float) -> None:
        if _finite(ttft_s):
            self.time_to_first_token.observe(max(ttft_s, 0.0))

    def observe_inter_token(self, itl_s: float) -> None:
        if _finite(itl_s):
            self.inter_token_latency.observe(max(itl_s, 0.0))

    def observe_finished(
        self, e2e_s: float, prompt_tokens: int, generation_tokens: int, finish_reason: FinishReason
    ) -> None:
        if _finite(e2e_s):
            self.e2e_request_latency.labels(finished_reason=finish_reason).observe(max(e2e_s, 0.0))
        self.request_prompt_tokens.observe(max(prompt_tokens, 0))
        self.request_generation_tokens.observe(max(generation_tokens, 0))

    def observe_stall(self) -> None:
        """Count one stall declared by the engine's watchdog (see :mod:`streamkv.watchdog`)."""
        self.engine_stalls.inc()

    def observe_threads(self, threads: int, dropped: bool) -> None:
        """The engine thread's torch threads now; ``dropped``: a drop to one (see :mod:`streamkv.thread_governor`)."""
        self.engine_threads.set(threads)
        if dropped:
            self.engine_thread_drops.inc()

    def observe_greedy_head(self, rows: int, candidates: int, fell_back: bool) -> None:
        """One step's run of the greedy head: ``rows`` greedy rows, ``candidates`` exact fp32 logits computed;
        ``fell_back``: a row it could not certify sent the step through the full logits (its rows not counted)."""
        if fell_back:
            self.greedy_head_fallbacks.inc()
            return
        self.greedy_head_rows.inc(max(rows, 0))
        self.greedy_head_candidates.inc(max(candidates, 0))

    def observe_loop_lag(self, lag_s: float) -> None:
        if _finite(lag_s):
            self.event_loop_lag.observe(max(lag_s, 0.0))

    def observe_gc_pause(self, generation: int, seconds: float) -> None:
        """One garbage collection's pause (``gc_control.CollectionTimer.drain`` calls it at each scrape)."""
        if _finite(seconds):
            self.gc_pause.labels(generation=str(generation)).observe(max(seconds, 0.0))

    def count_error(self, code: ErrorCode) -> None:
        """Count one error frame; ``code`` is a server-chosen stable code (bounded cardinality)."""
        self.errors.labels(code=code).inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition: ``(body, content_type)``."""
        if (timer := self._gc_timer) is not None:
            timer.drain(self.observe_gc_pause)
            with self._gc_lock:
                dropped = timer.dropped
                if timer is self._gc_timer and dropped > self._gc_dropped_seen:
                    self.gc_pauses_dropped.inc(dropped - self._gc_dropped_seen)
                    self._gc_dropped_seen = dropped
        if not self.const_labels:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        return generate_latest(_Labelled(self.registry, self.const_labels)), CONTENT_TYPE_LATEST


# ---------------------------------------------------------------- internals


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _num(d: Mapping[str, Any], key: str) -> float:
    """A non-negative finite number from ``d[key]``; absent or junk reads as 0."""
    v = d.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return 0.0
    return float(max(v, 0))


class _Labelled:
    """A registry seen through constant labels: every sample of every family gets ``labels`` added."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self._registry = registry
        self._labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [s._replace(labels={**s.labels, **self._labels}) for s in family.samples]
            yield labelled


class _SnapshotCollector(Collector):
    """Turns one ``snapshot(include_blocks=False)`` into gauge and counter families."""

    def __init__(self) -> None:
        self.snapshot_fn: SnapshotFn | None = None
        self._warned = threading.Event()

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        fn = self.snapshot_fn
        if fn is None:
            return
        try:
            snap = fn()
        except Exception:  # a broken snapshot must not take the histograms down with it
            if not self._warned.is_set():
                self._warned.set()
                logger.exception("stats snapshot failed during a /metrics scrape")
            return
        yield from _families(snap)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _offload_families(off: Mapping[str, Any]) -> Iterator[Metric]:
    """Idle sessions off the device pool (``snap["offload"]``, see ``OffloadStats``)."""
    sessions = GaugeMetricFamily(
        "streamkv_offload_sessions", "Idle sessions whose KV is off the pool.", labels=["tier"]
    )
    blocks = GaugeMetricFamily("streamkv_offload_blocks", "KV blocks of offloaded sessions.", labels=["tier"])
    for tier in ("host", "disk"):
        sessions.add_metric([tier], _num(off, f"{tier}_sessions"))
        blocks.add_metric([tier], _num(off, f"{tier}_blocks"))
    yield sessions
    yield blocks
    yield _gauge("streamkv_offload_disk_bytes", "Bytes of session files in --kv-offload-dir.", _num(off, "disk_bytes"))
    moves = CounterMetricFamily(
        "streamkv_offload_transfers", "Sessions moved between tiers (drop: KV forgotten).", labels=["kind"]
    )
    kinds = {"offload": "offloaded", "restore": "restored", "spill": "spilled", "disk_restore": "disk_restored"}
    for kind, field in kinds.items():
        moves.add_metric([kind], _num(off, f"{field}_sessions"))
    moves.add_metric(["drop"], _num(off, "dropped_sessions"))
    yield moves
    nbytes = CounterMetricFamily("streamkv_offload_bytes", "KV bytes moved between tiers.", labels=["kind"])
    for kind, field in {"offload": "offloaded", "restore": "restored", "disk_write": "disk_written",
                        "disk_read": "disk_read"}.items():  # fmt: skip
        nbytes.add_metric([kind], _num(off, f"{field}_bytes"))
    yield nbytes
    yield _counter("streamkv_offload_disk_errors", "Session files not written or not usable.", _num(off, "disk_errors"))


def _families(snap: Mapping[str, Any]) -> Iterator[Metric]:
    requests = snap.get("requests") or {}
    sessions = snap.get("sessions") or {}
    counts = snap.get("counts") or {}
    counters = snap.get("counters") or {}
    finished = snap.get("finished") or {}

    yield _gauge("streamkv_num_requests_running", "Requests in the running batch.", _num(requests, "running"))
    yield _gauge("streamkv_num_requests_waiting", "Requests waiting to be scheduled.", _num(requests, "waiting"))
    yield _gauge("streamkv_num_requests_swapped", "Requests swapped out to host memory.", _num(requests, "swapped"))
    yield _gauge(
        "streamkv_kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", min(_num(snap, "kv_usage"), 1.0)
    )
    blocks = GaugeMetricFamily("streamkv_kv_blocks", "KV blocks by state.", labels=["state"])
    for state in BLOCK_STATES:
        blocks.add_metric([state], _num(counts, state))
    yield blocks
    kv_cache = snap.get("kv_cache")
    if kv_cache:
        info = GaugeMetricFamily("streamkv_kv_cache_info", "KV cache storage dtype (value 1).", labels=["dtype"])
        info.add_metric([str(kv_cache.get("dtype"))], 1.0)
        yield info
        yield _gauge(
            "streamkv_kv_cache_bytes_per_token",
            "KV bytes per token across all layers, scales included.",
            _num(kv_cache, "bytes_per_token"),
        )
    yield _gauge("streamkv_active_sessions", "Chat sessions the engine knows.", _num(sessions, "active"))
    yield _gauge("streamkv_pinned_blocks", "KV blocks pinned by idle sessions.", _num(sessions, "pinned_blocks"))
    yield _gauge("streamkv_generation_tokens_per_second", "Recent generation throughput.", _num(snap, "tokens_per_s"))

    yield _counter("streamkv_prompt_tokens", "Prompt tokens of admitted requests.", _num(counters, "prompt_tokens"))
    yield _counter("streamkv_generation_tokens", "Generated tokens.", _num(counters, "generation_tokens"))
    yield _counter(
        "streamkv_computed_prompt_tokens",
        "Prompt tokens actually computed (not cached).",
        _num(counters, "computed_prompt_tokens"),
    )
    yield _counter(
        "streamkv_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        _num(counters, "prefix_cache_queries"),
    )
    yield _counter(
        "streamkv_prefix_cache_hits", "Prompt tokens found in the prefix cache.", _num(counters, "prefix_cache_hits")
    )
    preemptions = CounterMetricFamily("streamkv_num_preemptions", "Preemptions by mode.", labels=["mode"])
    for mode in PreemptionMode:
        preemptions.add_metric([mode.value], _num(counters, f"preemptions_{mode.value}"))
    yield preemptions
    yield _counter("streamkv_kv_evictions", "Cached blocks evicted for reuse.", _num(counters, "evictions"))
    yield _counter("streamkv_cow_copies", "Copy-on-write block copies.", _num(counters, "cow_copies"))
    yield _counter(
        "streamkv_swapped_out_blocks", "Blocks copied out to host memory.", _num(counters, "swapped_out_blocks")
    )
    yield from _offload_families(snap.get("offload") or {})
    success = CounterMetricFamily(
        "streamkv_request_success", "Finished requests by reason.", labels=["finished_reason"]
    )
    for reason in sorted(set(FINISH_REASONS) | set(finished)):
        success.add_metric([str(reason)], _num(finished, reason))
    yield success
