"""Smoke runs of the load generator (load_tests/loadgen.py) against real servers on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.metrics import EngineMetrics
from streamkv.model.loader import LoadedModel

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "server"))  # the uvicorn harness
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # load_tests/ is not an installed package
from server_harness import RunningServer, make_server, wait_for  # noqa: E402

from load_tests import loadgen  # noqa: E402

# slow: the tiny model borrows the real SmolLM2 tokenizer (the GGUF load takes seconds, once per run).
pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def _server(tiny_model_dir: str, tiny: LoadedModel, max_model_len: int) -> Iterator[RunningServer]:
    from streamkv.engine import AsyncEngine

    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"),
        cache=CacheConfig(num_blocks=256),
        scheduler=SchedulerConfig(max_model_len=max_model_len),
    )
    metrics = EngineMetrics()
    with make_server(AsyncEngine(config, metrics, loaded=tiny), metrics=metrics) as srv:
        yield srv


@pytest.fixture
def tiny_server(tiny_model_dir: str, tiny: LoadedModel) -> Iterator[RunningServer]:
    yield from _server(tiny_model_dir, tiny, max_model_len=1024)


@pytest.fixture
def short_server(tiny_model_dir: str, tiny: LoadedModel) -> Iterator[RunningServer]:
    """max_model_len 64: a request for 100 new tokens is refused with prompt_too_long."""
    yield from _server(tiny_model_dir, tiny, max_model_len=64)


def test_loadgen_smoke_three_sessions_two_turns(tiny_server: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    argv = ["--url", tiny_server.ws_url(), "--sessions", "3", "--turns", "2", "--system-tokens", "64",
            "--user-words", "4:12", "--max-tokens", "6:6", "--ignore-eos", "--think-time", "0.05:0.2", "--ramp", "0.5",
            "--stats-interval", "0.1", "--duration", "45", "--request-timeout", "30", "--no-progress",
            "--out", str(out)]  # fmt: skip
    assert loadgen.main(argv) == 0
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["errors"] == s["empty"] == s["incomplete"] == s["turns_not_started"] == 0, s
    assert s["requests_ok"] == 6 and len(data["requests"]) == 6
    assert all(r["output_tokens"] == 6 and r["finish_reason"] == "length" for r in data["requests"])
    assert s["output_tokens"] == 36
    assert 0 < s["ttft_ms_p50"] <= s["ttft_ms_p90"] <= s["ttft_ms_p99"] < 30_000
    assert 0 < s["itl_ms_p50"] <= s["itl_ms_p99"] < 30_000
    assert s["output_tokens_per_s"] > 0 and s["requests_per_s"] > 0
    # Turn 2 continues turn 1's pinned blocks. (Prefix hits on the shared system prompt depend on
    # timing: prompts admitted in the same step find nothing committed yet.)
    turn2 = [r for r in data["requests"] if r["turn"] == 1]
    assert all(r["cached_tokens"] > 0 for r in turn2)
    assert 0 <= s["prefix_hit_rate"] <= 1 and 0 < s["cached_prompt_share"] <= 1
    assert s["preemptions"] == 0 and 0 <= s["max_kv_usage"] <= 1 and s["stats_samples"] >= 1
    assert data["machine"]["cores"] >= 1 and "loadgen" in data["command"]
    assert out.with_suffix(".png").stat().st_size > 0

    def pool_idle() -> bool:
        snap = tiny_server.engine.snapshot(include_blocks=False)
        return snap["requests"]["running"] == 0 and snap["counts"]["used"] == snap["counts"]["shared"] == 0

    wait_for(pool_idle, timeout=10, what="every request finished and its blocks back")


def test_loadgen_fails_loudly_on_server_errors(short_server: RunningServer, tmp_path: Path) -> None:
    """The command line exits 1 with a FAILED line when the server refuses every request."""
    cmd = [sys.executable, "-m", "load_tests.loadgen", "--url", short_server.ws_url(), "--sessions", "2",
           "--turns", "1", "--system-tokens", "0", "--user-words", "3:3", "--max-tokens", "100:100",
           "--duration", "30", "--no-progress", "--out", str(tmp_path / "bad.json")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "LOADGEN FAILED: 2 request(s) errored" in proc.stderr and "prompt_too_long" in proc.stderr
    summary = json.loads((tmp_path / "bad.json").read_text())["summary"]
    assert summary["errors"] == 2 and summary["requests_ok"] == 0


def test_spawned_server_refuses_host_and_port_overrides() -> None:
    from load_tests.common import SpawnedServer

    with pytest.raises(ValueError, match="must not set --host/--port"):
        SpawnedServer(["--host", "0.0.0.0"])
