"""The default model behind the real server: the README's promise, end to end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import RunningServer, chat_turn, connect_chat, make_server

from streamkv.config import EngineConfig, ModelConfig
from streamkv.metrics import EngineMetrics
from streamkv.model.loader import LoadedModel

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture
def smollm2_server(smollm2: LoadedModel) -> Iterator[RunningServer]:
    from streamkv.engine import AsyncEngine

    metrics = EngineMetrics()
    engine = AsyncEngine(EngineConfig(model=ModelConfig(device="cpu")), metrics, loaded=smollm2)
    with make_server(engine, metrics=metrics) as srv:
        yield srv


def test_paris_then_a_follow_up_in_context(smollm2_server: RunningServer) -> None:
    greedy = {"max_tokens": 48, "temperature": 0}
    with connect_chat(smollm2_server) as ws:
        t1 = chat_turn(ws, "What is the capital of France?", params=greedy, timeout=120)
        assert t1.done is not None, t1.frames
        assert "Paris" in t1.text[0], t1.text
        assert sum(f["type"] == "delta" for f in t1.frames) > 1  # streamed, not in one piece
        t2 = chat_turn(ws, "What language do people speak there?", params=greedy, timeout=120)
        assert t2.done is not None, t2.frames
        assert "French" in t2.text[0], t2.text
        # turn 2 continues from turn 1's pinned blocks: only its new tokens are computed
        u1, u2 = t1.done["usage"], t2.done["usage"]
        assert u2["cached_tokens"] == u1["prompt_tokens"] + u1["completion_tokens"] - 1
