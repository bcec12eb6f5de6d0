"""The default model (SmolLM2-135M-Instruct) through the openai SDK: the README's three lines work."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from server_harness import RunningServer, make_server

from streamkv.config import EngineConfig, ModelConfig, ServerConfig
from streamkv.metrics import EngineMetrics
from streamkv.model.loader import LoadedModel

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture
def smollm2_server(smollm2: LoadedModel) -> Iterator[RunningServer]:
    from streamkv.engine import AsyncEngine

    metrics = EngineMetrics()
    engine = AsyncEngine(EngineConfig(model=ModelConfig(device="cpu")), metrics, loaded=smollm2)
    with make_server(engine, metrics=metrics, server_config=ServerConfig()) as srv:
        yield srv


def test_paris_from_chat_completions(smollm2_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=smollm2_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=model, messages=question, temperature=0, max_tokens=48)  # type: ignore[arg-type]
    assert "Paris" in (reply.choices[0].message.content or ""), reply
    stream = client.chat.completions.create(model=model, messages=question, temperature=0, max_tokens=48, stream=True)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content
