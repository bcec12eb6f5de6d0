"""The soak's memory probe (load_tests/heap_probe.py) and its growth report (load_tests/bench_soak.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # load_tests/ is not an installed package

from load_tests.bench_soak import probe_growth  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and glibc's mallinfo2")


def _reading(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {"rss_mb": 100.0, "rss_trimmed_mb": 90.0, "malloc_in_use_mb": 50.0,
                               "py_blocks": 1000, "asyncio_tasks": 4, "threads": 9, "onednn_linear_shapes": 10,
                               "gc_types": {}}  # fmt: skip
    return {**base, **kw}


def test_probe_growth_names_what_grew() -> None:
    first = _reading(gc_types={"builtins.dict": 10, "streamkv.sched.request.Request": 2})
    last = _reading(rss_mb=130.0, py_blocks=1500, onednn_linear_shapes=25,
                    gc_types={"builtins.dict": 40, "streamkv.sched.request.Request": 1, "asyncio.Task": 3})  # fmt: skip
    growth = probe_growth(first, last)
    assert growth["rss_mb"] == 30.0 and growth["py_blocks"] == 500 and growth["onednn_linear_shapes"] == 15
    assert growth["threads"] == 0 and "traced_mb" not in growth  # absent from both readings: not reported
    assert growth["gc_types_grown"] == {"builtins.dict": 30, "asyncio.Task": 3}  # largest first, shrunk types left out


def test_probe_growth_diffs_tracemalloc_snapshots(tmp_path: Path) -> None:
    tracemalloc.start(1)
    try:
        tracemalloc.take_snapshot().dump(str(tmp_path / "a.snap"))
        kept = [bytearray(4096) for _ in range(64)]  # 256 KiB live on one line
        tracemalloc.take_snapshot().dump(str(tmp_path / "b.snap"))
    finally:
        tracemalloc.stop()
    growth = probe_growth(_reading(snap=str(tmp_path / "a.snap")), _reading(snap=str(tmp_path / "b.snap")))
    assert len(kept) == 64
    assert "test_heap_probe.py" in growth["heap_top_lines"][0] and "KiB" in growth["heap_top_lines"][0]


@pytest.mark.timeout(120)
def test_probe_answers_sigusr1_and_counts_linear_shapes(tmp_path: Path) -> None:
    """A process with the probe installed writes one reading per SIGUSR1; each new row count is a new shape."""
    script = textwrap.dedent(f"""
        import os, signal, time
        from pathlib import Path
        import torch
        from load_tests.heap_probe import Probe
        from streamkv.model.linear import Linear

        probe = Probe(Path({str(tmp_path)!r}), trace_frames=None)
        probe.install()
        layer = Linear(8, 4, bias=False)
        layer.prepack(1)
        os.kill(os.getpid(), signal.SIGUSR1)
        for rows in (1, 3, 3, 5):
            layer(torch.randn(rows, 8))
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    first, last = (json.loads((tmp_path / f"probe-{n}.json").read_text()) for n in (0, 1))
    assert (first["n"], last["n"]) == (0, 1)
    assert (first["onednn_linear_shapes"], last["onednn_linear_shapes"]) == (0, 3)  # rows 1, 3, 5
    assert last["onednn_cache_capacity"] > 0 and last["threads"] >= 1 and last["py_blocks"] > 0
    assert last["malloc_in_use_mb"] > 0 and last["rss_trimmed_mb"] > 0 and last["gc_types"]["builtins.dict"] > 0


def test_onednn_cache_capacity_is_the_larger_of_onednn_and_ideep(monkeypatch: pytest.MonkeyPatch) -> None:
    from load_tests.heap_probe import onednn_cache_capacity

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    assert onednn_cache_capacity() == 1024  # both defaults
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "64")
    assert onednn_cache_capacity() == 1024  # oneDNN's own cache keeps filling up to 1024 shapes
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
    assert onednn_cache_capacity() == 64  # both full once 64 shapes have run
