"""The server in front of the real AsyncEngine (tiny random Llama, SmolLM2 tokenizer)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import (
    RunningServer,
    chat_frame,
    chat_turn,
    connect_chat,
    make_server,
    recv_until,
    send_json,
    wait_for,
)

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.metrics import EngineMetrics
from streamkv.model.loader import LoadedModel

# slow: the tiny model borrows the real SmolLM2 tokenizer (the GGUF load takes seconds, once per run).
pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


@pytest.fixture
def real_server(tiny_model_dir: str, tiny: LoadedModel) -> Iterator[RunningServer]:
    from streamkv.engine import AsyncEngine

    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"),
        cache=CacheConfig(num_blocks=128),
        scheduler=SchedulerConfig(max_model_len=1024),
    )
    metrics = EngineMetrics()
    engine = AsyncEngine(config, metrics, loaded=tiny)
    with make_server(engine, metrics=metrics) as srv:
        yield srv


def test_conversation_cancel_and_disconnect_with_the_real_engine(real_server: RunningServer) -> None:
    import sys

    from streamkv.engine import SWITCH_INTERVAL_S

    engine = real_server.engine
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)  # set by the engine's start
    greedy = {"max_tokens": 6, "temperature": 0}
    with connect_chat(real_server) as ws:
        t1 = chat_turn(ws, "Hello!", params=greedy, timeout=60)
        assert t1.done is not None, t1.frames
        assert t1.done["usage"]["completion_tokens"] == len(t1.token_ids[0])
        t2 = chat_turn(ws, "And then?", params=greedy, timeout=60)
        assert t2.done is not None, t2.frames
        # Turn 2 reuses turn 1's pinned blocks: only the new tokens are computed.
        assert t2.done["usage"]["cached_tokens"] >= t1.done["usage"]["prompt_tokens"]
        send_json(ws, chat_frame("Tell me a long story.", params={"max_tokens": 500, "temperature": 0}))
        recv_until(ws, {"delta"}, timeout=60)
        send_json(ws, {"type": "cancel"})
        assert recv_until(ws, {"done"}, timeout=60)[-1]["finish_reason"] == "cancelled"
        send_json(ws, chat_frame("Again, longer.", params={"max_tokens": 500, "temperature": 0}))
        recv_until(ws, {"delta"}, timeout=60)

    # Disconnect mid-answer: the request is aborted and the session released.
    def pool_idle() -> bool:
        counts = engine.snapshot(include_blocks=False)["counts"]
        return counts["used"] == counts["pinned"] == counts["shared"] == 0

    wait_for(pool_idle, timeout=30, what="every block back in the pool")
    snap = real_server.get("/api/stats").json()
    assert snap["requests"]["running"] == 0 and snap["sessions"]["active"] == 0
    assert snap["finished"]["cancelled"] == 2
    metrics_text = real_server.get("/metrics").text
    assert 'streamkv_request_success_total{finished_reason="cancelled"} 2.0' in metrics_text
