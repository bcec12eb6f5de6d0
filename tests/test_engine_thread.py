"""The engine is built on a short-lived thread, so that only the engine thread keeps OpenMP workers.

A thread that runs an OpenMP parallel region keeps its team of workers until it exits; with more
libgomp threads than CPUs, every region then sleeps and wakes instead of spinning, and the engine
thread's decode steps took twice as long (``streamkv.engine.run_in_own_thread``).
"""

from __future__ import annotations

import threading

import pytest

import streamkv.engine as engine_module
from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.engine import run_in_own_thread
from streamkv.model.loader import LoadedModel


def test_run_in_own_thread_returns_from_a_thread_that_has_exited() -> None:
    ran_on: list[threading.Thread] = []

    def work() -> int:
        ran_on.append(threading.current_thread())
        return 42

    assert run_in_own_thread(work, "probe") == 42
    (thread,) = ran_on
    assert thread is not threading.main_thread() and thread.name == "probe" and not thread.is_alive()


def test_run_in_own_thread_raises_the_functions_error() -> None:
    def fail() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        run_in_own_thread(fail, "probe")


def test_the_async_engine_builds_its_core_off_the_main_thread(
    tiny_model_dir: str, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    built_on: list[threading.Thread] = []

    class Recording(engine_module.EngineCore):
        def __init__(self, *args: object, **kwargs: object) -> None:
            built_on.append(threading.current_thread())
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_module, "EngineCore", Recording)
    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"),
        cache=CacheConfig(num_blocks=32),
        scheduler=SchedulerConfig(max_model_len=256),
    )
    engine = engine_module.AsyncEngine(config, loaded=tiny)
    (thread,) = built_on
    assert thread is not threading.main_thread() and not thread.is_alive()
    assert isinstance(engine.core, Recording)
