"""/healthz reports a stalled engine as degraded (issue #15 item 3)."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from server_harness import RunningServer

pytestmark = pytest.mark.timeout(30)


def test_healthz_degraded_while_the_engine_is_stalled(server: RunningServer, engine: FakeEngine) -> None:
    engine.stalled = True  # AsyncEngine.stalled reads the engine's watchdog
    r = server.get("/healthz")
    assert r.status_code == 503
    assert r.json() == {"status": "degraded", "model": "fake-model", "max_model_len": 2048}
    engine.stalled = False
    r = server.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"
