"""The load's gauges: its wall time by source, and the GGUF cache's bytes against its bound."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from streamkv.config import ModelConfig
from streamkv.model.gguf_cache import MANIFEST
from streamkv.server.load_gauges import register_load_gauges


def test_the_load_and_the_cache_bytes_are_gauges(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    register_load_gauges(registry, 2.5, "gguf_cache", ModelConfig(gguf_cache_dir=str(tmp_path), gguf_cache_space=999))
    assert registry.get_sample_value("streamkv_model_load_seconds", {"source": "gguf_cache"}) == 2.5
    assert registry.get_sample_value("streamkv_gguf_cache_space_bytes") == 999
    assert registry.get_sample_value("streamkv_gguf_cache_bytes") == 0
    entry = tmp_path / "m-0123"
    entry.mkdir()
    (entry / "model.safetensors").write_bytes(b"x" * 300)
    (entry / MANIFEST).write_text("{}")
    (tmp_path / ".m-4567.1.tmp").mkdir()  # a write in progress is not an entry yet
    assert registry.get_sample_value("streamkv_gguf_cache_bytes") == 302  # summed at each scrape


def test_without_a_cache_only_the_load_is_reported() -> None:
    registry = CollectorRegistry()
    register_load_gauges(registry, 1.0, "folder", ModelConfig(gguf_cache_dir=None))
    assert registry.get_sample_value("streamkv_model_load_seconds", {"source": "folder"}) == 1.0
    assert registry.get_sample_value("streamkv_gguf_cache_bytes") is None
