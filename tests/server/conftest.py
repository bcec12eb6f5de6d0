"""Fixtures: a FakeEngine behind a real uvicorn server (see server_harness.py).

To run the same tests against another engine, build it and use
``server_harness.make_server(engine)`` directly.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from server_harness import RunningServer, make_server

from streamkv.metrics import EngineMetrics


@pytest.fixture
def metrics() -> EngineMetrics:
    return EngineMetrics()


@pytest.fixture
def engine(metrics: EngineMetrics) -> FakeEngine:
    return FakeEngine(metrics=metrics)


@pytest.fixture
def server(engine: FakeEngine, metrics: EngineMetrics) -> Iterator[RunningServer]:
    with make_server(engine, metrics=metrics) as srv:
        yield srv
