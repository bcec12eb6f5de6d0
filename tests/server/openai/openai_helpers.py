"""Shared by the OpenAI API tests: engine sizes, the key, and a plain JSON POST."""

from __future__ import annotations

from typing import Any

import httpx
from server_harness import RunningServer

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.metrics import EngineMetrics
from streamkv.model.loader import LoadedModel

MAX_MODEL_LEN = 256
NUM_BLOCKS = 64
API_KEY = "sk-test-streamkv"


def build_engine(
    tiny_model_dir: str, tiny: LoadedModel, *, max_model_len: int = MAX_MODEL_LEN, num_blocks: int = NUM_BLOCKS
) -> tuple[Any, EngineMetrics]:
    from streamkv.engine import AsyncEngine

    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu", seed=0),
        cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_model_len=max_model_len),
    )
    metrics = EngineMetrics()
    return AsyncEngine(config, metrics, loaded=tiny), metrics


def post_json(srv: RunningServer, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(srv.http_url + path, json=body, timeout=60, **kwargs)
