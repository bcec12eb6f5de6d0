"""Shared by the OpenAI API tests: engine sizes, the key, and a plain JSON POST."""

from __future__ import annotations

from typing import Any

import httpx
from server_harness import RunningServer
from server_harness import build_engine as harness_engine

from streamkv.metrics import EngineMetrics
from streamkv.model.loader import LoadedModel

MAX_MODEL_LEN = 256
NUM_BLOCKS = 64
API_KEY = "sk-test-streamkv"


def build_engine(
    tiny_model_dir: str, tiny: LoadedModel, *, max_model_len: int = MAX_MODEL_LEN, num_blocks: int = NUM_BLOCKS
) -> tuple[Any, EngineMetrics]:
    """:func:`server_harness.build_engine` at the OpenAI tests' sizes."""
    return harness_engine(tiny_model_dir, tiny, max_model_len=max_model_len, num_blocks=num_blocks)


def post_json(srv: RunningServer, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(srv.http_url + path, json=body, timeout=60, **kwargs)
