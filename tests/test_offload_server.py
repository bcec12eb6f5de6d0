"""A server restarted with the same --kv-offload-dir resumes a conversation from its saved KV (tiny model)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "server"))  # the server tests' harness

from server_harness import RunningServer, chat_turn, connect_chat, make_server, wait_for  # noqa: E402

from streamkv.config import CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from streamkv.model.loader import LoadedModel  # noqa: E402
from streamkv.server.sessions import SessionState  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]
GREEDY = {"max_tokens": 9, "temperature": 0}


def serve(tiny: LoadedModel, tiny_model_dir: str, offload_dir: Path) -> RunningServer:
    from streamkv.engine import AsyncEngine

    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"),
        cache=CacheConfig(num_blocks=256, kv_offload_dir=str(offload_dir)),
    )
    return make_server(AsyncEngine(config, loaded=tiny))


def test_restart_resumes_with_cached_tokens_covering_history(tiny, tiny_model_dir, tmp_path):
    with serve(tiny, tiny_model_dir, tmp_path) as srv:
        with connect_chat(srv) as ws:
            t1 = chat_turn(ws, "First question.", resumable=True, params=GREEDY, timeout=60)
        assert t1.done is not None and t1.session_id is not None
        sid = t1.session_id
        history = t1.done["usage"]["prompt_tokens"] + t1.done["usage"]["completion_tokens"]
        wait_for(lambda: srv.app.state.sessions.num_detached == 1, timeout=30, what="session detached")
    assert len(list(tmp_path.glob("*.kv"))) == 1  # shutdown saved the detached session's pin

    with serve(tiny, tiny_model_dir, tmp_path) as srv:
        restored = srv.app.state.sessions.get(sid)
        assert restored is not None and restored.state is SessionState.DETACHED and len(restored.history) == history
        with connect_chat(srv) as ws:
            t2 = chat_turn(ws, "Second question.", session_id=sid, params=GREEDY, timeout=60)
        assert t2.done is not None, t2.frames
        assert t2.frames[0]["num_tokens"] == history
        # every history token but the last sampled one (never computed) comes back from disk
        assert t2.done["usage"]["cached_tokens"] == history - 1
        assert srv.engine.core.stats.kv.offload.disk_restored_sessions == 1
