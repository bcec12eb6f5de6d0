"""Fixtures: the real AsyncEngine (tiny random Llama, SmolLM2 tokenizer) behind uvicorn, and an openai client."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from openai_helpers import API_KEY, build_engine
from server_harness import RunningServer, make_server

from streamkv.config import ServerConfig
from streamkv.model.loader import LoadedModel


@pytest.fixture(scope="module")
def api_server(tiny_model_dir: str, tiny: LoadedModel) -> Iterator[RunningServer]:
    """One server per module, serving the tiny model as ``tiny`` (tests leave its pool idle)."""
    engine, metrics = build_engine(tiny_model_dir, tiny)
    config = ServerConfig(stats_interval=0.05, served_model_name="tiny", max_body_bytes=1 << 20)
    with make_server(engine, metrics=metrics, server_config=config) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir: str, tiny: LoadedModel) -> Iterator[RunningServer]:
    engine, metrics = build_engine(tiny_model_dir, tiny)
    config = ServerConfig(stats_interval=0.05, served_model_name="tiny", api_key=API_KEY)
    with make_server(engine, metrics=metrics, server_config=config) as srv:
        yield srv


@pytest.fixture
def client(api_server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=api_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
