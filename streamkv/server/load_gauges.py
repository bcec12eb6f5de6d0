"""Gauges of the model load: how long startup's load took and where it came from, and the GGUF cache's bytes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from streamkv.config import ModelConfig


def register_load_gauges(registry: CollectorRegistry, seconds: float, source: str, config: ModelConfig) -> None:
    """``streamkv_model_load_seconds{source}``, and with a GGUF cache ``streamkv_gguf_cache_{bytes,space_bytes}``.

    ``seconds`` is the load's wall time (``LoadedModel.load_seconds``) and
    ``source`` where transformers' load came from: ``gguf`` (the file was
    parsed), ``gguf_cache`` (read from ``--gguf-cache-dir``) or ``folder``.
    The cache's bytes are summed at each scrape (a handful of files), so
    entries written by other processes count.
    """
    from prometheus_client import Gauge

    from streamkv.model.gguf_cache import GGUFCache

    load = Gauge(
        "streamkv_model_load_seconds",
        "Wall time of the model load at startup, by where transformers' load came from (gguf, gguf_cache, folder).",
        ["source"],
        registry=registry,
    )
    load.labels(source=source).set(seconds)
    if config.gguf_cache_dir is None:
        return
    cache = GGUFCache(Path(config.gguf_cache_dir), config.gguf_cache_space)
    used = Gauge("streamkv_gguf_cache_bytes", "Bytes of saved GGUF loads in --gguf-cache-dir.", registry=registry)
    used.set_function(cache.total_bytes)
    space = Gauge(
        "streamkv_gguf_cache_space_bytes",
        "Most bytes --gguf-cache-dir may hold (--gguf-cache-space).",
        registry=registry,
    )
    space.set(config.gguf_cache_space)
